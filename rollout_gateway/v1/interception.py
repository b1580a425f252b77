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
   judges the harness's exit (:mod:`.harness_sync`) and once more at slot release;
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
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from verifiers.v1.interception import Interception, Slot
from verifiers.v1.session import RolloutSession
from verifiers.v1.trace import Trace

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient, RetryPolicy
from rollout_gateway.errors import GatewayConfigError
from rollout_gateway.tunnels import (
    DirectTunnelProvider,
    PrimeTunnelProvider,
    TunnelPool,
    TunnelProvider,
)
from rollout_gateway.v1.config import GatewayInterceptionConfig
from rollout_gateway.v1.errors import GatewayFeatureError
from rollout_gateway.v1.features import session_features
from rollout_gateway.v1.harness_sync import forget
from rollout_gateway.v1.link import RegisterSpec, RolloutLink
from rollout_gateway.v1.trace_sync import TraceSync

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    """A rollout holding a gateway slot."""

    session: RolloutSession
    link: RolloutLink
    sync: TraceSync
    lock: asyncio.Lock


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
        if tunnel_provider is None:
            kind = self.config.tunnel
            if kind == "auto":
                kind = "prime" if requires_tunnel else "direct"
            tunnel_provider = PrimeTunnelProvider() if kind == "prime" else DirectTunnelProvider()
        self.tunnel_provider = tunnel_provider
        self.fallback = fallback if self.config.fallback else None
        self._transport = transport
        self._retry = retry
        self._admin_token = admin_token or os.environ.get(self.config.admin_token_var) or None
        self._clients: dict[str, GatewayClient] = {}
        self._tunnels: TunnelPool | None = None
        self._active: dict[str, _Active] = {}
        #: Send every rollout to ``fallback`` (the env sets it when the taskset's tool
        #: servers need the ``/state`` channel and ``fallback`` is on).
        self.force_fallback = False
        #: Registrations made and finalized (tests and benchmarks read them).
        self.registrations = 0
        self.finalizations = 0

    async def start(self) -> None:
        """Create the tunnel pool (tunnels open lazily, one per gateway host)."""
        self._tunnels = TunnelPool(self.tunnel_provider, default_port=self.config.port)
        self.stack.push_async_callback(self._close)
        if self.fallback is not None:
            await self.stack.enter_async_context(self.fallback)

    async def _close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        if self._tunnels is not None:
            await self._tunnels.stop_all()
        forget(self)

    def gateway_url(self, session: RolloutSession) -> str:
        """The gateway root: ``config.url``, else the run's client base URL minus ``/v1``."""
        if self.config.url:
            return protocol.gateway_root(self.config.url)
        base_url = getattr(session.ctx.client, "base_url", None)
        if not base_url:
            raise GatewayConfigError(
                "cannot derive the gateway URL: the model client has no base_url; "
                "set --env.interception.url"
            )
        url = protocol.gateway_root(str(base_url))
        if not url.startswith(("http://", "https://")):
            raise GatewayConfigError(f"model client base URL {base_url!r} is not http(s)")
        return url

    def _client(self, url: str) -> GatewayClient:
        client = self._clients.get(url)
        if client is None or client.is_closed:
            client = GatewayClient(
                url, admin_token=self._admin_token, retry=self._retry, transport=self._transport
            )
            self._clients[url] = client
        return client

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
        features = session_features(session)
        if self.force_fallback and self.fallback is not None:
            features.append("tool servers on the /state channel")
        if features:
            if self.fallback is None:
                raise GatewayFeatureError(features)
            logger.info("rollout %s: v1 interception (%s)", session.trace.id, "; ".join(features))
            async with self.fallback.acquire(session) as slot:
                yield slot
            return
        if self._tunnels is None:
            raise RuntimeError("GatewayInterception is not started (use `async with`)")
        link = RolloutLink(self._client(self.gateway_url(session)), self._tunnels)
        spec = self.register_spec(session)
        active = _Active(
            session=session,
            link=link,
            sync=TraceSync(
                session.trace,
                model=spec.model,
                sampling=session.ctx.sampling,
                rollout_id=link.rollout_id,
            ),
            lock=asyncio.Lock(),
        )
        trace_id = session.trace.id
        cancelled = False
        try:
            await link.register(spec)
            self.registrations += 1
            self._active[trace_id] = active
            root = await link.public_root()
            yield (root, link.api_key, "")
            await self._sync(active, exit_code=None)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._active.pop(trace_id, None)
            if link.registered:
                self.finalizations += 1
            error = await link.finalize(cancelled=cancelled)
            if error is not None and not cancelled:
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
            await self._sync(active, exit_code=exit_code)

    async def _sync(self, active: _Active, *, exit_code: int | None) -> None:
        async with active.lock:
            if active.session.released:
                return  # v1 sealed the trace: what it concluded is what scores
            answer = await active.link.trajectory()
            active.sync.apply(answer.get("trajectory") or [])
            trace = active.session.trace
            reported: Any = answer.get("stop_condition")
            if reported in protocol.LIMIT_STOP_CONDITIONS:
                trace.stop(str(reported))
            elif exit_code not in (None, 0):
                limit = active.session.limits.reached(trace)
                if limit is not None:
                    trace.stop(limit)


__all__ = ["GatewayInterception"]
