"""One gateway-mode rollout from register to teardown, independent of verifiers.

A :class:`GatewayRollout` owns one rollout: register, tunnel lease, agent launch and
completion wait (through the adapter's :class:`RolloutHooks`), trajectory fetch, the
scoring hand-off, and ONE finalize path that cancels, stops the agent, unregisters and
deletes exactly once each and leaves exactly one error and one stop condition.

Stack adapters (the verifiers 0.3 mixin, the verifiers v1 interception) subclass
:class:`RolloutHooks` to route each step through their own overridable methods; the
defaults use the core's operations. The core guarantees that every hook runs at most
once per rollout, whatever fails or is cancelled, and that finalize runs to its end
even if the rollout is cancelled again meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway import protocol
from rollout_gateway.errors import (
    AgentPollError,
    GatewayAuthError,
    GatewayConfigError,
    GatewayError,
    GatewayTunnelError,
    PostRolloutError,
    RolloutGatewayError,
    RolloutInfraError,
    RolloutNotFoundError,
    SandboxError,
)
from rollout_gateway.resources import GatewayResources
from rollout_gateway.rollout_steps import StepRunner
from rollout_gateway.tunnels import TunnelLease

logger = logging.getLogger(__name__)

#: What the agent gets as OPENAI_API_KEY when the gateway issues no per-rollout key.
PLACEHOLDER_API_KEY = "rollout-gateway-no-key"

#: Stop conditions the core sets (an adapter may map them onto its own names).
STOP_COMPLETED = "agent_completed"
STOP_AGENT_TIMEOUT = "agent_timeout"
STOP_ROLLOUT_TIMEOUT = "timeout_reached"
STOP_HAS_ERROR = "has_error"
STOP_CANCELLED = "cancelled"


@dataclass
class AgentExit:
    """How the agent's process ended."""

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""


@dataclass
class RolloutRecord:
    """Everything the core knows about one rollout; adapters mirror it into their state."""

    rollout_id: str
    gateway_url: str | None = None
    api_key: str | None = None
    tunnel_url: str | None = None
    agent_base_url: str | None = None
    sandbox_id: str | None = None
    agent_started: bool = False
    #: The agent runs behind the launch wrapper that reports its start and exit
    #: (:func:`rollout_gateway.launch.agent_launch_command`); without it the sandbox is
    #: polled adaptively, as no report can come.
    agent_reports: bool = False
    agent_exit: AgentExit | None = None
    #: The gateway refused a turn of the rollout (the refusal's code, from the exit
    #: channel): the agent was stopped then.
    refused: str | None = None
    agent_timed_out: bool = False
    agent_polls: int = 0
    trajectory: dict[str, Any] | None = None
    error: BaseException | None = None
    stop_condition: str | None = None
    cancelled: bool = False
    timed_out: bool = False
    #: A register request may have reached the gateway (set before it is sent).
    register_sent: bool = False
    registered: bool = False
    times: dict[str, float] = field(default_factory=dict)

    def fail(self, error: BaseException) -> None:
        """Record ``error`` unless an earlier one already explains the rollout."""
        if self.error is None:
            self.error = error


class RolloutHooks:
    """The steps of one rollout; adapters override them, the core calls each at most once.

    The defaults use the core's own operations and do nothing for the sandbox steps
    (an adapter whose agent runs elsewhere, e.g. in verifiers v1's harness runtime,
    keeps them).
    """

    def __init__(self, rollout: GatewayRollout) -> None:
        self.rollout = rollout

    async def register(self) -> None:
        """Register the rollout with the gateway."""
        raise NotImplementedError("an adapter must say what to register (model, sampling)")

    async def open_tunnel(self) -> None:
        """Lease the shared tunnel of the rollout's gateway."""
        await self.rollout.lease_tunnel()

    async def launch(self) -> None:
        """Create the sandbox and start the agent."""

    async def wait(self) -> None:
        """Return once the agent exited (bounded by the core's agent timeout)."""

    async def fetch(self) -> None:
        """Fetch the trajectory."""
        await self.rollout.fetch_trajectory()

    async def check(self) -> None:
        """Judge the agent's outcome (raise to fail the rollout)."""

    async def score(self) -> None:
        """Sandbox-side scoring, while the sandbox still exists."""

    async def release(self) -> None:
        """Release the adapter's own per-rollout resources (always runs)."""

    async def stop_agent(self) -> None:
        """Stop an agent still running (before scoring)."""

    async def cancel(self) -> None:
        """Cancel the rollout at the gateway: its later turns are refused."""
        await self.rollout.cancel()

    async def unregister(self) -> None:
        """Unregister the rollout at the gateway."""
        await self.rollout.unregister()

    async def delete_sandbox(self) -> None:
        """Delete the rollout's sandbox."""


#: The agent's client timeouts in :func:`agent_environment`: defaults, which an env
#: author's own values of the same variables override (the rest always win).
AGENT_TIMEOUT_VARS = frozenset({"OPENAI_TIMEOUT", "OPENAI_REQUEST_TIMEOUT", "HTTPX_TIMEOUT"})


def agent_environment(
    base_url: str, api_key: str | None, model: str, agent_timeout: float | None
) -> dict[str, str]:
    """The variables that point an agent at its rollout on the gateway, whichever client
    it uses: the OpenAI SDK's (``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, chat completions
    and Responses) and the Anthropic SDK's and Claude Code's (``ANTHROPIC_BASE_URL`` /
    ``ANTHROPIC_API_KEY``, Messages; the SDK appends ``/v1/messages`` to the rollout's
    URL, sends the key as ``x-api-key``; ``ANTHROPIC_MODEL`` is Claude Code's model), so
    an env switches agents by changing only its command.

    The client timeouts follow the agent timeout, so a slow turn is not cut short by
    the SDK's own default.
    """
    timeout = str(int(agent_timeout)) if agent_timeout is not None else "86400"
    key = api_key or PLACEHOLDER_API_KEY
    return {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": key,
        "OPENAI_MODEL": model,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": model,
        "OPENAI_TIMEOUT": timeout,
        "OPENAI_REQUEST_TIMEOUT": timeout,
        "HTTPX_TIMEOUT": timeout,
    }


def _is_typed(error: BaseException) -> bool:
    return isinstance(error, RolloutGatewayError)


def _is_infra(error: BaseException) -> bool:
    return isinstance(error, RolloutInfraError)


class GatewayRollout:
    """One rollout's lifecycle. Create one per rollout; call :meth:`execute`.

    Args:
        resources: the env's shared clients and tunnels.
        rollout_id: the rollout's id (default: a fresh unguessable one).
        is_typed: whether an error raised by a hook is already typed (kept as is);
            others are wrapped into the failing stage's error type.
        is_infra: whether an error is an infrastructure failure (no scoring then).
    """

    def __init__(
        self,
        resources: GatewayResources,
        *,
        rollout_id: str | None = None,
        is_typed: Callable[[BaseException], bool] = _is_typed,
        is_infra: Callable[[BaseException], bool] = _is_infra,
    ) -> None:
        self.resources = resources
        self.settings = resources.settings
        self.record = RolloutRecord(rollout_id or protocol.new_rollout_id())
        self._is_typed = is_typed
        self._is_infra = is_infra
        self.steps = StepRunner(
            self.record.rollout_id,
            finalize_step_timeout=self.settings.finalize_step_timeout,
            is_typed=is_typed,
            # The record's, not ours: a bound method of this rollout held by its own
            # runner is a reference cycle, and each rollout's trajectory would then wait
            # for the garbage collector (longer collections under a burst).
            fail=self.record.fail,
        )
        self._lease: TunnelLease | None = None
        self._proposed_key = protocol.new_rollout_api_key()
        self._unregistered = False
        self._cancel_sent = False

    @property
    def rollout_id(self) -> str:
        """The rollout's id."""
        return self.record.rollout_id

    # ---------------------------------------------------------------- operations

    def is_typed(self, error: BaseException) -> bool:
        """Whether ``error`` is already typed for this rollout's adapter (kept as raised)."""
        return self._is_typed(error)

    def fail(self, error: BaseException) -> None:
        """Record ``error`` unless an earlier one already explains the rollout."""
        self.record.fail(error)

    async def register(
        self,
        *,
        model: str,
        sampling_params: dict[str, Any] | None = None,
        max_turns: int = protocol.UNLIMITED_TURNS,
        max_seq_len: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> protocol.RegisterResponse:
        """Register with the gateway; the answer's (or our proposed) key becomes ``api_key``.

        The rollout counts as possibly registered *before* the request goes out, so a
        cancellation while it is in flight still unregisters it.
        """
        record = self.record
        if record.gateway_url is None:
            raise GatewayError("register: the rollout has no gateway_url")
        client = self.resources.client(record.gateway_url)
        record.register_sent = True
        try:
            answer = await client.register(
                record.rollout_id,
                model=model,
                sampling_params=sampling_params,
                max_turns=max_turns,
                max_seq_len=max_seq_len,
                api_key=self._proposed_key,
                extra=extra,
            )
        except GatewayAuthError:
            # A refused admin token (a configuration error, raised before any sandbox
            # starts): nothing was registered, so finalize has nothing to unregister.
            record.register_sent = False
            raise
        record.registered = True
        record.api_key = answer.get("api_key") or None
        return answer

    async def lease_tunnel(self) -> str:
        """Lease the tunnel of the rollout's gateway; returns the agent's base URL."""
        record = self.record
        if record.gateway_url is None:
            raise GatewayTunnelError("tunnel: the rollout has no gateway_url")
        self._lease = await self.resources.tunnels.lease(record.gateway_url)
        record.tunnel_url = self._lease.url
        record.agent_base_url = protocol.rollout_base_url(self._lease.url, record.rollout_id)
        return record.agent_base_url

    def agent_env(self, model: str) -> dict[str, str]:
        """The variables the agent needs to reach the gateway as this rollout
        (:func:`agent_environment`)."""
        record = self.record
        if record.agent_base_url is None:
            raise GatewayTunnelError("agent_env: no tunnel leased yet")
        return agent_environment(
            record.agent_base_url, record.api_key, model, self.settings.agent_timeout
        )

    @property
    def lease(self) -> TunnelLease | None:
        """The rollout's tunnel lease, once leased."""
        return self._lease

    async def fetch_trajectory(self, *, expand: bool = True) -> dict[str, Any]:
        """Fetch the recorded trajectory into ``record.trajectory`` (``expand=False``: a
        delta-form answer as it came, see :meth:`GatewayClient.get_trajectory`)."""
        record = self.record
        assert record.gateway_url is not None
        client = self.resources.client(record.gateway_url)
        answer = await client.get_trajectory(record.rollout_id, expand=expand)
        record.trajectory = dict(answer)
        return record.trajectory

    async def cancel(self) -> None:
        """Cancel at the gateway, once, if the rollout may be registered (best effort)."""
        record = self.record
        if not record.register_sent or self._unregistered or self._cancel_sent:
            return
        self._cancel_sent = True
        assert record.gateway_url is not None
        try:
            await self.resources.client(record.gateway_url).cancel(record.rollout_id)
        except GatewayError as e:
            logger.warning("rollout=%s cancel failed: %s", record.rollout_id, e)

    async def unregister(self) -> None:
        """Unregister, once, if the rollout may be registered. A 404 means already gone."""
        record = self.record
        if not record.register_sent or self._unregistered:
            return
        self._unregistered = True
        assert record.gateway_url is not None
        try:
            await self.resources.client(record.gateway_url).unregister(record.rollout_id)
        except RolloutNotFoundError:
            logger.debug("rollout=%s was not registered (or already gone)", record.rollout_id)

    # ---------------------------------------------------------------- the sequence

    async def execute(self, hooks: RolloutHooks, *, timeout: float | None = None) -> None:
        """Run every stage, then finalize. Only cancellation and configuration errors
        escape, after finalize (see :meth:`run_finalize`).

        ``timeout`` bounds the stages (the env's whole-rollout timeout): past it the
        rollout ends with stop condition ``timeout_reached``.
        """
        task = asyncio.current_task()
        if task is not None:
            self.resources.track(task)
        self.record.times["start"] = time.time()
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:  # in this task: no task per rollout for the deadline
                await self._stages(hooks)
        except asyncio.CancelledError:
            self.record.cancelled = True
        except TimeoutError as e:
            if deadline.expired():
                self.record.timed_out = True
            else:
                self.fail(self.steps.typed(e, RolloutInfraError, "rollout"))
        except Exception as e:  # _stages types every error; this is a last resort
            self.fail(self.steps.typed(e, RolloutInfraError, "rollout"))
        await self.run_finalize(hooks)

    async def run_finalize(self, hooks: RolloutHooks) -> None:
        """Run :meth:`finalize` in its own task, to its end even if the caller is cancelled
        meanwhile; a cancelled rollout then re-raises the cancellation, and one that
        failed on a :class:`GatewayConfigError` (e.g. the gateway refused the admin
        token) raises it: no retry of the rollout can fix it, so it must not pass for
        one failed rollout among many."""
        finalize = asyncio.ensure_future(self.finalize(hooks))
        while not finalize.done():
            try:
                await asyncio.shield(finalize)
            except asyncio.CancelledError:
                self.record.cancelled = True
        if self.record.cancelled:
            raise asyncio.CancelledError
        if isinstance(self.record.error, GatewayConfigError):
            raise self.record.error

    async def _stages(self, hooks: RolloutHooks) -> None:
        await self.steps.run("register", hooks.register, GatewayError)
        await self.steps.run("tunnel", hooks.open_tunnel, GatewayTunnelError)
        await self.steps.run("launch", hooks.launch, SandboxError)
        self.record.times["agent_start"] = time.time()
        await self.steps.run("wait", hooks.wait, AgentPollError)
        self.record.times["agent_end"] = time.time()
        await self.steps.run("fetch", hooks.fetch, GatewayError)
        await self.steps.run("check", hooks.check, RolloutInfraError)

    async def finalize(self, hooks: RolloutHooks) -> None:
        """The one teardown path. Never raises; each step runs at most once.

        Run it in a task of its own (:meth:`run_finalize`): its steps run to their end
        (each bounded by ``finalize_step_timeout``) through any cancellation.

        1. A cancelled or timed-out rollout, and one whose started agent did not exit on
           its own (agent timeout, tunnel death, a failure), is cancelled at the gateway,
           so the agent adds no turn.
        2. A timed-out agent is stopped, and what the gateway recorded is fetched.
        3. Sandbox-side scoring runs unless the rollout was cancelled or failed for
           infrastructure reasons.
        4. The adapter's own release; unregister; delete the sandbox.
        5. Exactly one stop condition.
        """
        record = self.record
        # An agent that may still be running must add no turn (one never started cannot);
        # a cancelled or timed-out rollout is cancelled at the gateway in any case.
        agent_loose = record.agent_started and record.agent_exit is None
        if (agent_loose or record.cancelled or record.timed_out) and record.register_sent:
            await self.steps.quiet("cancel", hooks.cancel)
        if record.agent_timed_out or record.timed_out:
            if record.agent_started and agent_loose:
                await self.steps.quiet("stop_agent", hooks.stop_agent)
            if record.registered and not self.steps.ran("fetch"):
                await self.steps.guarded("fetch", hooks.fetch, GatewayError)
        if not record.cancelled and not self._infra_failed() and not self._misconfigured():
            await self.steps.guarded("score", hooks.score, PostRolloutError)
        await self.steps.guarded("release", hooks.release, RolloutInfraError)
        if record.register_sent:  # never for a rollout whose register failed
            await self.steps.guarded("unregister", hooks.unregister, GatewayError)
        await self.steps.guarded("delete_sandbox", hooks.delete_sandbox, SandboxError)
        record.times["end"] = time.time()
        record.stop_condition = self._stop_condition()

    def _infra_failed(self) -> bool:
        return self.record.error is not None and self._is_infra(self.record.error)

    def _misconfigured(self) -> bool:
        return isinstance(self.record.error, GatewayConfigError)

    def _stop_condition(self) -> str:
        record = self.record
        if record.cancelled:
            return STOP_CANCELLED
        if record.error is not None:
            return STOP_HAS_ERROR
        if record.timed_out:
            return STOP_ROLLOUT_TIMEOUT
        if record.agent_timed_out:
            return STOP_AGENT_TIMEOUT
        return STOP_COMPLETED


__all__ = [
    "AGENT_TIMEOUT_VARS",
    "PLACEHOLDER_API_KEY",
    "STOP_AGENT_TIMEOUT",
    "STOP_CANCELLED",
    "STOP_COMPLETED",
    "STOP_HAS_ERROR",
    "STOP_ROLLOUT_TIMEOUT",
    "AgentExit",
    "GatewayRollout",
    "RolloutHooks",
    "RolloutRecord",
    "agent_environment",
]
