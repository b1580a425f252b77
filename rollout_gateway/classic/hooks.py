"""The lifecycle core's steps routed through a verifiers 0.3 env's overridable methods.

:class:`ClassicHooks` is the bridge between :class:`rollout_gateway.lifecycle.GatewayRollout`
and the env (:class:`rollout_gateway.classic.mixin.RolloutGatewayMixin`): each core step
calls the env's method of the earlier experimental mixin's name and signature (so an
override written for it runs, once), then mirrors what it learned between the verifiers
state and the core's record. The env is typed as :class:`GatewaySteps`, what the hooks
call of it, so this module never imports the mixin that imports it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from rollout_gateway import protocol
from rollout_gateway.classic.errors import to_vf_error
from rollout_gateway.classic.stops import LIMIT_STOPS, TRUNCATING_STOPS, limit_stop
from rollout_gateway.errors import (
    AgentCrashError,
    AgentStartError,
    EmptyTrajectoryError,
    EngineError,
)
from rollout_gateway.lifecycle import (
    STOP_AGENT_TIMEOUT,
    STOP_CANCELLED,
    STOP_COMPLETED,
    AgentExit,
    GatewayRollout,
    RolloutHooks,
)

if TYPE_CHECKING:
    from prime_sandboxes import CreateSandboxRequest
    from verifiers.types import State

    from rollout_gateway.settings import GatewaySettings


class GatewaySteps(Protocol):
    """What a rollout's hooks call of its env: the earlier mixin's overridable steps and
    the ``CliAgentEnv`` hooks around them (``RolloutGatewayMixin`` has them all)."""

    gateway_settings: GatewaySettings

    async def register_rollout(self, state: State) -> None: ...
    async def get_gateway_tunnel_url(self, local_addr: str | None = None) -> str: ...
    async def build_env_vars(self, state: State) -> dict[str, str]: ...
    async def build_sandbox_request(
        self, state: State, env_vars: dict[str, str]
    ) -> CreateSandboxRequest: ...
    async def create_sandbox(self, state: State, request: CreateSandboxRequest) -> Any: ...
    async def start_agent(self, state: State) -> None: ...
    async def wait_for_agent_completion(self, state: State) -> None: ...
    async def fetch_trajectory(self, state: State) -> None: ...
    async def is_completed(self, state: State) -> bool: ...
    async def post_rollout(self, state: State) -> None: ...
    async def cleanup(self, state: State) -> None: ...
    async def stop_agent(self, state: State) -> None: ...
    async def cancel_rollout(self, state: State) -> None: ...
    async def unregister_rollout(self, state: State) -> None: ...
    async def delete_rollout_sandbox(self, state: State) -> None: ...
    def mark_timed_out(self, state: State) -> None: ...


def exit_from_state(state: State) -> AgentExit | None:
    """The agent's exit as the state records it, if it exited."""
    if "agent_exit_code" not in state:
        return None
    return AgentExit(
        state.get("agent_exit_code"),
        state.get("agent_stdout") or "",
        state.get("agent_stderr") or "",
    )


class ClassicHooks(RolloutHooks):
    """Core steps -> the env's methods (:class:`GatewaySteps`), for one rollout's ``state``."""

    def __init__(self, rollout: GatewayRollout, env: GatewaySteps, state: State) -> None:
        super().__init__(rollout)
        self.env = env
        self.state = state

    @property
    def record(self) -> Any:
        return self.rollout.record

    async def register(self) -> None:
        # Counted as possibly registered before any request, so it is unregistered
        # even when an override registers by other means or is cancelled mid-flight.
        self.record.register_sent = True
        try:
            await self.env.register_rollout(self.state)
        except Exception:
            # As the earlier mixin: a rollout whose register failed is not unregistered
            # (an override's unregister_rollout may assume a registered rollout). One the
            # gateway did register before the answer was lost expires at its idle TTL.
            self.record.register_sent = False
            raise

    async def open_tunnel(self) -> None:
        state = self.state
        host = protocol.gateway_host(state["gateway_url"])
        state["tunnel_local_addr"] = host
        url = await self.env.get_gateway_tunnel_url(local_addr=host)
        state["tunnel_url"] = url
        lease = self.rollout.lease  # None when an override found the URL its own way
        state["tunnel_id"] = lease.tunnel_id if lease is not None else None
        state["rollout_base_url"] = protocol.rollout_base_url(url, state["rollout_id"])
        self.record.tunnel_url = url
        self.record.agent_base_url = state["rollout_base_url"]

    async def launch(self) -> None:
        env, state = self.env, self.state
        env_vars = await env.build_env_vars(state)
        request = await env.build_sandbox_request(state, env_vars)
        await env.create_sandbox(state, request)
        self.record.sandbox_id = state.get("sandbox_id")
        state["agent_completed"] = False
        self.record.agent_started = True
        try:
            await env.start_agent(state)
        except Exception as e:
            if self.rollout.is_typed(e):
                raise
            raise AgentStartError(f"failed to start agent: {type(e).__name__}: {e}") from e
        if state.get("background_job") is None:  # the override ran the agent to its end
            self.record.agent_exit = exit_from_state(state) or AgentExit(None)

    async def wait(self) -> None:
        await self.env.wait_for_agent_completion(self.state)
        self.record.agent_timed_out = bool(self.state.get("agent_timed_out"))
        if not self.record.agent_timed_out:
            self.record.agent_exit = self.record.agent_exit or exit_from_state(self.state)

    async def fetch(self) -> None:
        state = self.state
        await self.env.fetch_trajectory(state)
        # The limit the gateway enforced, as CliAgentEnv names its stop (it checks its
        # stops every turn; here they are known once the trajectory is): set before
        # scoring, so post_rollout and verifiers' own stop checks see it.
        stop = limit_stop(state.get("gateway_truncation_reason"), self.record.refused)
        if stop is not None and not state.get("is_completed"):
            state["stop_condition"] = stop
            state["is_completed"] = True
            if stop in TRUNCATING_STOPS:
                state["prompt_too_long"] = True
                state["is_truncated"] = True

    async def check(self) -> None:
        env, state = self.env, self.state
        num_turns = len(state.get("trajectory") or [])
        exit_code = state.get("agent_exit_code")
        # Ended at a limit the gateway enforced (fetch set its stop): a non-zero exit is
        # the agent dying on the refusal, or stopped for it, not a crash; as CliAgentEnv,
        # which stops the agent itself at such a limit.
        at_limit = self.record.refused is not None or (
            state.get("is_completed") and state.get("stop_condition") in LIMIT_STOPS
        )
        if exit_code not in (None, 0) and not state.get("agent_timed_out") and not at_limit:
            outage = self._engine_failure(num_turns)
            if outage is not None:  # the agent died on the engine's failures
                raise to_vf_error(
                    EngineError(
                        f"the engine behind the gateway failed the agent's last model call "
                        f"({outage}); the agent then exited (exit_code={exit_code}, "
                        f"rollout_id={state['rollout_id']})"
                    )
                )
            from verifiers.envs.experimental.cli_agent_env import make_agent_error

            where = "before any model call" if num_turns == 0 else f"after {num_turns} turn(s)"
            stderr_tail = (state.get("agent_stderr") or "")[-2000:]
            crash = make_agent_error(  # verifiers' message, with the sandbox's context
                state, f"Agent crashed {where} (exit_code={exit_code}): {stderr_tail}"
            )
            raise to_vf_error(AgentCrashError(*crash.args))  # both classes: see .errors
        if num_turns == 0 and not env.gateway_settings.allow_empty_trajectory:
            raise EmptyTrajectoryError(
                f"agent exited (exit_code={exit_code}) without a model call "
                f"(rollout_id={state['rollout_id']})"
            )

    def _engine_failure(self, num_turns: int) -> str | None:
        """The engine failure of the agent's last model call, when the gateway recorded
        one (``failed_turns`` after the last recorded turn), else ``None``."""
        answer = self.record.trajectory or {}
        failed = [
            f
            for f in answer.get("failed_turns") or ()
            if isinstance(f, dict) and f.get("after_steps") == num_turns
        ]
        if not failed:
            return None
        error = failed[-1].get("error") or {}
        status = error.get("upstream_status") or error.get("status_code")
        return f"{error.get('type')} {status}: {error.get('message')}"

    async def score(self) -> None:
        env, state = self.env, self.state
        if not state.get("is_completed"):
            await env.is_completed(state)  # renders stop fields post_rollout may read
        if state.get("sandbox_id"):
            await env.post_rollout(state)

    async def release(self) -> None:
        await self.env.cleanup(self.state)  # the env's own @vf.cleanup handlers

    async def stop_agent(self) -> None:
        await self.env.stop_agent(self.state)

    async def cancel(self) -> None:
        await self.env.cancel_rollout(self.state)

    async def unregister(self) -> None:
        await self.env.unregister_rollout(self.state)

    async def delete_sandbox(self) -> None:
        await self.env.delete_rollout_sandbox(self.state)

    def render_outcome(self) -> None:
        """The rollout ended: its error, stop condition and timing on the state."""
        state, record = self.state, self.rollout.record
        state.setdefault("agent_timed_out", record.agent_timed_out)
        if "agent_exit_code" not in state and record.agent_exit is not None:
            state["agent_exit_code"] = record.agent_exit.exit_code
        if record.error is not None:
            state["error"] = to_vf_error(record.error)
        if record.stop_condition == STOP_CANCELLED:
            return
        if record.timed_out:
            self.env.mark_timed_out(state)
        if state.get("completion") is None:
            state["completion"] = []
        state["is_completed"] = True
        # verifiers' own stop condition (rendered before scoring) names a clean ending
        # more precisely (e.g. max_turns_reached); an error or timeout always wins.
        if record.stop_condition not in (STOP_COMPLETED, STOP_AGENT_TIMEOUT) or not state.get(
            "stop_condition"
        ):
            state["stop_condition"] = record.stop_condition
        timing = state["timing"]
        timing.setup.end = record.times.get("agent_start", timing.setup.start)
        timing.generation.end = time.time()


__all__ = ["ClassicHooks", "GatewaySteps", "exit_from_state"]
