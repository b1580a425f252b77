"""``GatewayInterception``: v1's ``Interception`` contract, served by the rollout gateway.

v1 hands each rollout a *slot* ``(base_url, model_secret, state_secret)`` from its
interception, and the harness calls ``{base_url}/v1/chat/completions`` with the model
secret as bearer key. Here the slot points at the inference server's rollout gateway
(through the shared tunnel of its host): ``(tunnel URL, per-rollout key, "")``, so no
model call crosses the env process. Per rollout:

1. refuse (or hand to the opt-in ``fallback`` interception) a task whose hooks need the
   env on every model call (:mod:`rollout_gateway.v1.features`);
2. register model, sampling, v1's limits and ``max_seq_len`` (:mod:`.link`);
3. yield the slot; the harness runs;
4. :meth:`GatewayInterception.sync` rebuilds the trace from the recorded turns
   (:mod:`.trace_sync`) and sets a limit stop the gateway reported; it runs before v1
   judges the harness's exit (at the end of each harness segment, :mod:`.harness_sync`)
   and once more at slot release;
5. unregister exactly once (cancel first when the rollout was cancelled).

Use it directly::

    async with GatewayInterception(GatewayInterceptionConfig(tunnel="direct")) as gi:
        agent = vf.Agent(config, interception=gi)
        gateway_synced_agent(agent, gi)
        trace = await agent.run(task)

or through an env: :class:`rollout_gateway.v1.GatewayEnvMixin`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollout_gateway import protocol
from rollout_gateway.client import RetryPolicy
from rollout_gateway.errors import RolloutGatewayError
from rollout_gateway.lifecycle import AgentExit, GatewayRollout, RolloutHooks
from rollout_gateway.resources import GatewayResources
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.tunnels import TunnelProvider
from rollout_gateway.v1.config import GatewayInterceptionConfig
from rollout_gateway.v1.errors import feature_error, interception_error, to_v1_error
from rollout_gateway.v1.features import session_features
from rollout_gateway.v1.internals import Interception, RolloutSession, Slot, Trace
from rollout_gateway.v1.refusals import RefusalWatch
from rollout_gateway.v1.stops import limit_stop, refusal_stop
from rollout_gateway.v1.trace_sync import TraceSync

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegisterSpec:
    """What a rollout registers: model, sampling, v1's limits and the context bound."""

    model: str
    sampling_params: dict[str, Any]
    max_turns: int = protocol.UNLIMITED_TURNS
    max_seq_len: int | None = None
    limits: dict[str, int] = field(default_factory=dict)


@dataclass
class _Active:
    """A rollout holding a gateway slot."""

    session: RolloutSession
    rollout: GatewayRollout
    sync: TraceSync
    lock: asyncio.Lock
    spec: RegisterSpec
    #: v1 judged the harness's exit (the sync hook ran with its exit code).
    harness_exited: bool = False
    #: The trace holds every turn: synced after the last harness segment exited (and no
    #: segment started since), so the release need not fetch the trajectory again.
    exit_synced: bool = False
    #: A trajectory fetch failed and v1 got its error: the rollout records it once, so
    #: the release does not fetch (and fail) again.
    sync_failed: bool = False
    #: The limit the gateway reported refusing a turn on the exit channel (v1's name).
    refused: str | None = None


class _V1Hooks(RolloutHooks):
    """The core's finalize steps for a v1 rollout: v1's runtime owns the agent, so the
    sandbox steps stay no-ops and only cancel/unregister reach the gateway."""


class GatewayInterception(Interception):
    """v1 ``Interception`` whose slots are rollouts registered at the rollout gateway.

    Args:
        config: the ``[env.interception]`` block (``type = "gateway"``).
        requires_tunnel: whether some agent runs off this host (``tunnel = "auto"``
            then means ``prime``, else ``direct``).
        tunnel_provider: a :class:`TunnelProvider` overriding ``config.tunnel``.
        fallback: v1's own interception, used for tasks whose hooks need the env on
            every call when ``config.fallback`` is set; entered and stopped with this one.
        transport: httpx transport of the control-plane clients (tests).
        retry: retry policy of control-plane calls.
        admin_token: control-plane token (default: ``$`` ``config.admin_token_var``).
    """

    def __init__(
        self,
        config: GatewayInterceptionConfig | None = None,
        *,
        requires_tunnel: bool = True,
        tunnel_provider: TunnelProvider | None = None,
        fallback: Interception | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        retry: RetryPolicy | None = None,
        admin_token: str | None = None,
    ) -> None:
        super().__init__()
        self.config = config or GatewayInterceptionConfig()
        kind = self.config.tunnel
        if kind == "auto":
            kind = "prime" if requires_tunnel else "direct"
        #: The core's settings: v1 bounds the agent's time itself (no agent timeout here).
        self.settings = GatewaySettings(
            gateway_url=self.config.url,
            gateway_port=self.config.port,
            agent_timeout=None,
            tunnel_provider=tunnel_provider or kind,
            admin_token=admin_token,
            admin_token_env=self.config.admin_token_var,
            retry=retry or RetryPolicy(),
            transport=transport,
        )
        # Read now: the token leaves this process's environment before any agent starts.
        self.settings.resolved_admin_token()
        self.fallback = fallback if self.config.fallback else None
        self._resources: GatewayResources | None = None
        self._active: dict[str, _Active] = {}
        #: Send every rollout to ``fallback`` (the env sets it when the taskset's tool
        #: servers need the ``/state`` channel and ``fallback`` is on).
        self.force_fallback = False
        #: Registrations made (tests and benchmarks read them).
        self.registrations = 0

    async def start(self) -> None:
        """Create the core's resources (clients and tunnels open lazily, one per gateway).

        With ``config.url`` set, the gateway's acceptance of the admin token is checked
        here, so a refused token stops the env before any rollout starts a runtime
        (:class:`~rollout_gateway.errors.GatewayAuthError`, naming the setting). Without
        it the URL comes with each rollout's client, and the first rollout's register
        meets the refusal; later rollouts then fail without calling the gateway.
        """
        self._resources = GatewayResources(
            self.settings, self.settings.resolved_tunnel_provider(local=False)
        )
        self.stack.push_async_callback(self._close)
        if self.config.url:
            url = self.settings.resolve_gateway_url(None, how_to_set="--env.interception.url")
            await self._resources.client(url).check_admin_token()
        if self.fallback is not None:
            await self.stack.enter_async_context(self.fallback)

    async def _close(self) -> None:
        # Rollouts still holding a slot are cancelled: each finalizes (cancel, unregister).
        if self._resources is not None:
            await self._resources.aclose()

    def gateway_url(self, session: RolloutSession) -> str:
        """The gateway root: ``config.url``, else the run's client base URL minus ``/v1``."""
        return self.settings.resolve_gateway_url(
            getattr(session.ctx.client, "base_url", None), how_to_set="set --env.interception.url"
        )

    def register_spec(self, session: RolloutSession) -> RegisterSpec:
        """Model, sampling, v1's limits and ``max_seq_len`` of ``session``'s rollout."""
        sampling = session.ctx.sampling.model_dump(exclude_none=True)
        limits = session.limits
        token_limits = {
            name: value
            for name in protocol.TOKEN_LIMIT_FIELDS
            if (value := getattr(limits, name)) is not None
        }
        return RegisterSpec(
            model=session.ctx.model,
            sampling_params=protocol.flatten_sampling_args(sampling),
            max_turns=limits.max_turns
            if limits.max_turns is not None
            else protocol.UNLIMITED_TURNS,
            max_seq_len=self.config.max_seq_len,
            limits=token_limits,
        )

    @contextlib.asynccontextmanager
    async def acquire(self, session: RolloutSession) -> AsyncIterator[Slot]:
        """Register ``session``'s rollout and yield its slot; sync and unregister on exit."""
        features = self._env_side_features(session)
        if features:
            if self.fallback is None:
                raise feature_error(features)  # v1's TaskError: stop task_error
            logger.info("rollout %s: v1 interception (%s)", session.trace.id, "; ".join(features))
            async with self.fallback.acquire(session) as slot:
                yield slot
            return
        resources = self._resources
        if resources is None:
            raise RuntimeError("GatewayInterception is not started (use `async with`)")
        active = self._new_active(session, resources)
        rollout, trace_id = active.rollout, session.trace.id
        task = asyncio.current_task()
        if task is not None:
            resources.track(task)
        try:
            slot = await self._open(active)
            self._active[trace_id] = active
            yield slot
            await self._release(active)
        except asyncio.CancelledError:
            rollout.record.cancelled = True
            raise
        except BaseException as e:
            rollout.fail(e)
            raise
        finally:
            self._active.pop(trace_id, None)
            await self._finalize(rollout)

    def _env_side_features(self, session: RolloutSession) -> list[str]:
        """What of ``session`` needs the env on every turn (then v1's own interception
        serves it, or it is refused); empty when the gateway can serve it."""
        features = session_features(session)
        if self.force_fallback and self.fallback is not None:
            features.append("tool servers on the /state channel")
        return features

    def _new_active(self, session: RolloutSession, resources: GatewayResources) -> _Active:
        spec = self.register_spec(session)
        rollout = GatewayRollout(resources)
        rollout.record.gateway_url = self.gateway_url(session)
        sync = TraceSync(
            session.trace,
            model=spec.model,
            sampling=session.ctx.sampling,
            rollout_id=rollout.rollout_id,
        )
        return _Active(session=session, rollout=rollout, sync=sync, lock=asyncio.Lock(), spec=spec)

    async def _open(self, active: _Active) -> Slot:
        """Register the rollout and lease its tunnel: its slot (v1's errors on failure)."""
        rollout, spec = active.rollout, active.spec
        try:
            await rollout.register(
                model=spec.model,
                sampling_params=spec.sampling_params,
                max_turns=spec.max_turns,
                max_seq_len=spec.max_seq_len,
                extra=dict(spec.limits) or None,
            )
            self.registrations += 1
            await rollout.lease_tunnel()
        except RolloutGatewayError as e:
            raise to_v1_error(e, "gateway setup") from e
        record = rollout.record
        assert record.tunnel_url is not None
        if not record.api_key:
            # v1 harnesses reach the model at {base_url}/v1 and are told apart by
            # their bearer key alone: without one, rollouts could not be routed.
            raise interception_error(
                "the gateway issued no per-rollout api_key; verifiers v1 agents are "
                "routed by bearer key (start the gateway with per-rollout keys)"
            )
        return (record.tunnel_url, record.api_key, "")

    async def _release(self, active: _Active) -> None:
        """v1 released the slot: the agent is done, or aborted; the last turns synced."""
        record = active.rollout.record
        if active.harness_exited:
            # The harness program exited: nothing left to cancel.
            record.agent_exit = AgentExit(exit_code=None)
        else:
            # Released without v1 judging an exit: the rollout was aborted (cancelled,
            # failed in setup) while the agent may still run. Refuse its next turns
            # first; finalize then unregisters (the core sends each call once).
            await active.rollout.cancel()
        if not active.exit_synced:
            await self._sync(active, exit_code=None)

    async def _finalize(self, rollout: GatewayRollout) -> None:
        """The core's one finalize path (cancel if needed, unregister once), shielded."""
        error_before = rollout.record.error
        finalize = asyncio.ensure_future(rollout.finalize(_V1Hooks(rollout)))
        interrupted = False
        while not finalize.done():
            try:
                await asyncio.shield(finalize)
            except asyncio.CancelledError:
                interrupted = True
        if interrupted:
            raise asyncio.CancelledError
        error = rollout.record.error
        if error is not None and error is not error_before and not rollout.record.cancelled:
            # Teardown itself failed (e.g. unregister): the rollout records it, typed.
            if isinstance(error, RolloutGatewayError):
                raise to_v1_error(error, "gateway teardown") from error
            raise error

    async def sync(self, trace: Trace, *, exit_code: int | None = None) -> None:
        """Commit the turns the gateway recorded for ``trace``'s rollout so far.

        With the harness's ``exit_code``: a non-zero exit after a limit was reached is
        that limit's stop (the gateway refused the next turn, the harness died on the
        refusal), as v1's own server would have set it before answering. A trace with no
        gateway slot (fallback, or not registered) is left alone.
        """
        active = self._active.get(trace.id)
        if active is not None:
            if exit_code is not None:
                active.harness_exited = True
            await self._sync(active, exit_code=exit_code)
            active.exit_synced = exit_code is not None

    def segment_started(self, trace: Trace) -> None:
        """A harness segment of ``trace`` starts: turns may come that no sync has seen."""
        active = self._active.get(trace.id)
        if active is not None:
            active.exit_synced = False

    def refusal_watch(self, trace: Trace) -> RefusalWatch:
        """The refusal watch of ``trace``'s rollout: ``async with`` it around a harness
        segment, and the segment ends when the gateway refuses one of its turns (see
        :mod:`.refusals`). A trace with no gateway slot gets a watch that never fires."""
        active = self._active.get(trace.id)
        if active is None or not self.settings.exit_reports or self._resources is None:
            return RefusalWatch(None, None)
        record = active.rollout.record
        assert record.gateway_url is not None
        watcher = self._resources.exit_watcher(record.gateway_url)

        def refused(code: str) -> None:
            active.rollout.record.refused = code
            active.refused = refusal_stop(code)

        return RefusalWatch(watcher, record.rollout_id, on_refusal=refused)

    async def _sync(self, active: _Active, *, exit_code: int | None) -> None:
        async with active.lock:
            if active.session.released or active.sync_failed:
                # v1 sealed the trace (what it concluded is what scores), or already got
                # this rollout's fetch failure: one failure is recorded once.
                return
            try:
                answer = await active.rollout.fetch_trajectory(expand=False)
            except RolloutGatewayError as e:
                active.sync_failed = True
                raise to_v1_error(e, "gateway trajectory") from e
            active.sync.apply(answer)
            session = active.session
            trace = session.trace
            # The limit that refused a turn the agent asked for, under v1's name for it
            # (v1 counts these as truncation): the rollout's stop, as v1's server sets
            # it before it answers the refusal.
            reported: Any = answer.get("truncation_reason") or answer.get("truncated_reason")
            stop = limit_stop(reported) or active.refused
            if stop is not None:
                trace.stop(stop)
            elif exit_code not in (None, 0):
                limit = session.limits.reached(trace)
                if limit is not None:
                    trace.stop(limit)
            # What v1's server leaves on the session: the error of the latest exchange when
            # it failed (the engine behind the gateway), which v1 records instead of a
            # HarnessError when the harness dies on it (stop provider_error).
            session.error = active.sync.last_failure


__all__ = ["GatewayInterception"]
