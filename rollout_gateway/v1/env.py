"""Gateway mode as an interception type of a verifiers v1 ``Env``.

``GatewayEnvMixin`` goes in front of any ``vf.Env`` subclass whose config annotates
``interception`` with :data:`~rollout_gateway.v1.config.InterceptionChoice`; with
``[env.interception] type = "gateway"`` its rollouts run through the rollout gateway,
with any other type the env is v1's own, unchanged. :class:`GatewayEnv` is the ready
single-agent env (select it with ``--env.id rollout-gateway-env``).

What the mixin overrides, and why:

- ``serving()``: first makes sure v1 resolves the ``local_sandbox`` runtime type and that
  agents on it can get sandboxes on this host (a typed error before any rollout); builds a
  :class:`GatewayInterception` for the gateway type (v1's
  ``make_interception`` sends unknown types to its elastic pool); it refuses, before any
  rollout, a taskset whose tool servers need the env's ``/state`` channel, unless
  ``fallback`` is set, in which case v1's own interception (built by v1's
  ``make_interception`` from its default config) serves those tasks.
- ``_episode_agents()``: gives each agent's harness the segment hook of
  :mod:`rollout_gateway.v1.harness_sync` (v1 builds the agents of an episode there).

Each private name of v1 used here is in :data:`rollout_gateway.v1.internals.PRIVATE`.
- ``run_episode()``: records the traces of ``local_sandbox`` rollouts in v1's vocabulary
  before v1 writes or sends them (:mod:`rollout_gateway.v1.runtime_record`: v1's trace
  readers accept only v1's own runtime types), in every mode.

While the env serves, this package's log records go where v1's own go (v1's CLIs show
only the ``verifiers.v1`` logger): a refused admin token, logged once, reaches the
console of ``vf-eval`` beside the rollouts' ``InterceptionError``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from rollout_gateway.admin_token import take_admin_token
from rollout_gateway.v1.config import (
    GatewayInterceptionConfig,
    InterceptionChoice,
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
)
from rollout_gateway.v1.errors import GatewayFeatureError
from rollout_gateway.v1.features import toolset_features
from rollout_gateway.v1.harness_sync import gateway_synced
from rollout_gateway.v1.interception import GatewayInterception
from rollout_gateway.v1.internals import (
    ElasticInterceptionPoolConfig,
    Env,
    Interception,
    SingleAgentEnv,
    SingleAgentEnvConfig,
    agent_config_fields,
    make_interception,
)
from rollout_gateway.v1.runtime import check_local_sandbox, install
from rollout_gateway.v1.runtime_record import record_for_v1

if TYPE_CHECKING:
    from rollout_gateway.v1.internals import Env as _Base
else:
    _Base = object


@contextlib.contextmanager
def logs_beside_v1() -> Iterator[None]:
    """Send ``rollout_gateway``'s log records to the handlers of v1's logger meanwhile."""
    ours, v1 = logging.getLogger("rollout_gateway"), logging.getLogger("verifiers.v1")
    added = [
        h for h in v1.handlers if not isinstance(h, logging.NullHandler) and h not in ours.handlers
    ]
    propagate = ours.propagate
    for handler in added:
        ours.addHandler(handler)
    if added and not v1.propagate:  # v1's CLI took its records off the root: ours too
        ours.propagate = False
    try:
        yield
    finally:
        for handler in added:
            ours.removeHandler(handler)
        ours.propagate = propagate


class GatewayEnvMixin(_Base):
    """Adds the ``gateway`` interception type to a v1 ``Env`` (put it first in the bases).

    Attributes (tests and embedders set them before ``serving()``):
        gateway_transport: httpx transport of the control-plane clients.
        gateway_tunnel_provider: a ``TunnelProvider`` overriding the config's ``tunnel``.
        gateway_admin_token: the control-plane token, handed over directly (default: read
            from the variable the config's ``admin_token_var`` names).
    """

    gateway_transport: Any = None
    gateway_tunnel_provider: Any = None
    gateway_admin_token: str | None = None
    _interception: Interception | None

    @property
    def gateway_interception(self) -> GatewayInterception | None:
        """The live gateway interception (inside ``serving()`` in gateway mode), else None."""
        interception = getattr(self, "_interception", None)
        return interception if isinstance(interception, GatewayInterception) else None

    def _gateway_config(self) -> GatewayInterceptionConfig | None:
        config = self.config.interception
        return config if isinstance(config, GatewayInterceptionConfig) else None

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """v1's ``serving()``; in gateway mode with a :class:`GatewayInterception`."""
        await self._check_local_sandboxes()
        config = self._gateway_config()
        if config is not None:
            # Before any tool server or agent process starts: the token leaves this
            # process's environment (kept in memory for the interception).
            take_admin_token(config.admin_token_var)
        if config is None:
            async with super().serving():
                yield
            return
        with logs_beside_v1():
            async with self._gateway_serving(config):
                yield

    @contextlib.asynccontextmanager
    async def _gateway_serving(self, config: GatewayInterceptionConfig) -> AsyncIterator[None]:
        async with self.shared_tools() as shared:
            requires_tunnel = self._requires_tunnel(shared)
            fallback: Interception | None = None
            task_cls = type(self.taskset).task_type()
            needs_env = toolset_features(task_cls.toolsets(self.taskset.config.task), shared)
            if needs_env and not config.fallback:
                raise GatewayFeatureError(needs_env)
            if config.fallback:
                fallback = make_interception(
                    ElasticInterceptionPoolConfig(),
                    requires_tunnel=requires_tunnel,
                    state_service_secrets=tuple(
                        s.state_secret for s in shared.values() if s.state_secret
                    ),
                )
            interception = GatewayInterception(
                config,
                requires_tunnel=requires_tunnel,
                tunnel_provider=self.gateway_tunnel_provider,
                fallback=fallback,
                transport=self.gateway_transport,
                admin_token=self.gateway_admin_token,
            )
            # Toolsets in play: every rollout of this taskset goes to the fallback.
            interception.force_fallback = bool(needs_env)
            async with interception:
                self._shared_tools = shared
                self._interception = interception
                try:
                    await self.start()
                    yield
                finally:
                    try:
                        await self.stop()
                    finally:
                        self._shared_tools = {}
                        self._interception = None

    async def _check_local_sandboxes(self) -> None:
        """Before any rollout: v1 resolves the ``local_sandbox`` runtime type
        (:func:`~rollout_gateway.v1.install`, also for a config that arrived without
        validation), and every agent on it can get its sandboxes here (else
        :class:`~rollout_gateway.v1.LocalSandboxStartError`)."""
        for spec in agent_config_fields(self.config).values():
            if isinstance(spec.runtime, LocalSandboxRuntimeConfig):
                install()
                await check_local_sandbox(spec.runtime)

    async def run_episode(self, *args: Any, **kwargs: Any) -> Any:
        """v1's ``run_episode()``; each trace of a ``local_sandbox`` rollout recorded so
        that v1's readers (``vf-replay``, ``vf-eval --resume``, the env-server client)
        parse it (:func:`~rollout_gateway.v1.runtime_record.record_for_v1`)."""
        episode = await super().run_episode(*args, **kwargs)
        for trace in episode.traces:
            record_for_v1(trace)
        return episode

    def _episode_agents(self, *args: Any, **kwargs: Any) -> Any:
        agents = super()._episode_agents(*args, **kwargs)
        interception = self.gateway_interception
        if interception is not None:
            for name in agent_config_fields(self.config):
                agent = getattr(agents, name)
                agent.harness = gateway_synced(agent.harness, interception)
        return agents


class GatewayEnvConfig(SingleAgentEnvConfig):
    """``SingleAgentEnvConfig`` whose ``interception`` also accepts ``type = "gateway"``
    and whose agent's ``runtime`` also accepts ``type = "local_sandbox"``."""

    interception: InterceptionChoice = ElasticInterceptionPoolConfig()
    agent: LocalSandboxAgentConfig = LocalSandboxAgentConfig()


class GatewayEnv(GatewayEnvMixin, SingleAgentEnv, Env[GatewayEnvConfig]):
    """The single-agent env with the ``gateway`` interception type."""


__all__ = ["GatewayEnv", "GatewayEnvConfig", "GatewayEnvMixin"]
