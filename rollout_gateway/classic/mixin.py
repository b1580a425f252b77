"""``RolloutGatewayMixin``: gateway-mode rollouts for verifiers 0.3's ``vf.CliAgentEnv``.

A thin adapter: the lifecycle is :class:`rollout_gateway.lifecycle.GatewayRollout`;
this class maps it onto ``CliAgentEnv``'s hooks and state keys, and keeps the earlier
experimental mixin's (verifiers 0.1.11) overridable steps with their signatures, so an
env written for it runs unchanged. The steps about the agent's sandbox live in
:mod:`rollout_gateway.classic.agent_steps`, this class's base. With
``use_gateway = False`` every method falls through to ``CliAgentEnv``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import verifiers as vf
from verifiers.types import RolloutInput, SamplingArgs, State

from rollout_gateway import protocol
from rollout_gateway.classic.agent_steps import AgentSandboxSteps
from rollout_gateway.classic.hooks import ClassicHooks
from rollout_gateway.classic.rollouts import (
    StateRollouts,
    current_rollout,
    host_gateway_url,
    shared_tunnel_url,
)
from rollout_gateway.classic.trajectory import apply_trajectory, recorded_tools
from rollout_gateway.errors import (
    GatewayConfigError,
    RolloutGatewayError,
    RolloutInfraError,
    RolloutInputError,
)
from rollout_gateway.lifecycle import (
    GatewayRollout,
)
from rollout_gateway.resources import GatewayResources, ResourcesOwner
from rollout_gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

#: Environment variable selecting the sandbox backend ("prime" or "local").
SANDBOX_BACKEND_ENV = "ROLLOUT_GATEWAY_SANDBOX_BACKEND"
SANDBOX_BACKENDS = ("prime", "local")
_UNSET: Any = object()
#: 0.1.0's constructor keywords -> GatewaySettings fields (deprecated, still accepted).
DEPRECATED_KWARGS = {
    "gateway_port": "gateway_port",
    "gateway_url": "gateway_url",
    "gateway_timeout_seconds": "agent_timeout",
    "tunnel_provider": "tunnel_provider",
    "gateway_transport": "transport",
    "gateway_admin_token": "admin_token",
    "gateway_retry": "retry",
    "poll_policy": "poll",
    "allow_empty_trajectory": "allow_empty_trajectory",
}


def _is_vf_typed(error: BaseException) -> bool:
    return isinstance(error, vf.Error | RolloutGatewayError)


def _is_vf_infra(error: BaseException) -> bool:
    return isinstance(error, vf.InfraError | RolloutInfraError)


class RolloutGatewayMixin(AgentSandboxSteps):
    """Gateway mode for ``vf.CliAgentEnv`` (put it before ``CliAgentEnv`` in the bases).

    Class attributes, each overridable per instance through the constructor:
    ``use_gateway`` (default ``True``, as in the earlier mixin) and ``sandbox_backend``
    (``"prime"`` or ``"local"``; ``$ROLLOUT_GATEWAY_SANDBOX_BACKEND`` overrides the class
    default). Constructor keywords besides ``CliAgentEnv``'s: ``use_gateway``,
    ``sandbox_backend``, ``local_sandbox_root``, ``sandbox_client`` (a seam: any object
    with prime-sandboxes' async client methods) and ``gateway`` (a
    :class:`GatewaySettings` or a mapping of its field names).
    """

    use_gateway: bool = True
    sandbox_backend: str = "prime"

    def __init__(
        self,
        *args: Any,
        use_gateway: bool | None = None,
        sandbox_backend: str | None = None,
        local_sandbox_root: str | None = None,
        sandbox_client: Any | None = None,
        gateway: GatewaySettings | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._gateway_owner = ResourcesOwner(self._make_gateway_resources)
        self._gateway_rollouts = StateRollouts(self._new_rollout, self._state_gateway_url)
        settings = GatewaySettings.coerce(gateway)
        legacy = {k: kwargs.pop(k) for k in list(kwargs) if k in DEPRECATED_KWARGS}
        if legacy:
            warnings.warn(
                f"{sorted(legacy)} are deprecated: pass gateway=GatewaySettings(...) "
                f"(fields {sorted(DEPRECATED_KWARGS[k] for k in legacy)})",
                DeprecationWarning,
                stacklevel=2,
            )
            settings = settings.replace(
                **{DEPRECATED_KWARGS[k]: v for k, v in legacy.items() if v is not None}
            )
        self.gateway_settings = settings
        super().__init__(*args, **kwargs)
        if use_gateway is not None:
            self.use_gateway = use_gateway
        backend = sandbox_backend or os.environ.get(SANDBOX_BACKEND_ENV) or self.sandbox_backend
        if backend not in SANDBOX_BACKENDS:
            raise GatewayConfigError(
                f"sandbox_backend must be one of {SANDBOX_BACKENDS}, got {backend!r}"
            )
        self.sandbox_backend = backend
        if sandbox_client is not None:
            self._replace_sandbox_client(sandbox_client)
        elif backend == "local":
            from rollout_gateway.local_sandbox import IsolationUnavailableError, LocalSandboxClient

            try:
                local = LocalSandboxClient(root=local_sandbox_root)
            except IsolationUnavailableError as e:  # an env author's choice to make, up front
                raise GatewayConfigError(f"sandbox_backend='local': {e}") from e
            self._replace_sandbox_client(local)

    # ------------------------------------------------------------------ configuration

    def init_gateway(
        self,
        gateway_port: int = _UNSET,
        timeout_seconds: float | None = _UNSET,
        **settings: Any,
    ) -> None:
        """Configure gateway mode (the earlier mixin's call; may be called again).

        Only what is passed changes: ``gateway_port`` (default 8000),
        ``timeout_seconds`` (the agent timeout, default 21600 s; ``None`` = no limit)
        and any :class:`GatewaySettings` field by name. Settings and seams given to the
        constructor are kept. Resources (clients, tunnels) start lazily.
        """
        changes = dict(settings)
        if gateway_port is not _UNSET:
            changes["gateway_port"] = gateway_port
        if timeout_seconds is not _UNSET:
            changes["agent_timeout"] = timeout_seconds
        if self._gateway_owner.current is not None and changes:
            raise GatewayConfigError("init_gateway cannot change settings once rollouts started")
        self.gateway_settings = self.gateway_settings.replace(**changes)

    def gateway_resources(self) -> GatewayResources:
        """The env's clients and tunnels (created with the first gateway rollout).

        A method, not a property: verifiers discovers decorated hooks with ``getattr``
        on every attribute, which would create the resources at construction. After the
        env's teardown, rollouts get a fresh set closed when the last of them ends
        (:class:`~rollout_gateway.resources.ResourcesOwner`).
        """
        return self._gateway_owner.get()

    def _make_gateway_resources(self) -> GatewayResources:
        provider = self.gateway_settings.resolved_tunnel_provider(
            local=self.sandbox_backend == "local"
        )
        return GatewayResources(self.gateway_settings, provider)

    def _new_rollout(
        self, rollout_id: str | None, resources: GatewayResources | None = None
    ) -> GatewayRollout:
        return GatewayRollout(
            resources or self.gateway_resources(),
            rollout_id=rollout_id,
            is_typed=_is_vf_typed,
            is_infra=_is_vf_infra,
        )

    def _state_gateway_url(self, state: State) -> str:
        """The gateway of a state's rollout, for a step called on its own (:mod:`.rollouts`)."""
        if state.get("gateway_url"):
            return str(state["gateway_url"])
        if state.get("tunnel_local_addr"):
            return host_gateway_url(self.gateway_settings, state["tunnel_local_addr"])
        return self.resolve_gateway_url(state)

    def _replace_sandbox_client(self, client: Any) -> None:
        threaded = getattr(self, "sandbox_client", None)
        if threaded is not None and hasattr(threaded, "teardown"):
            threaded.teardown(wait=False)  # its worker threads are not needed
        self.sandbox_client = client

    def resolve_gateway_url(self, state: State) -> str:
        """Gateway root: the ``gateway_url`` setting, else the client's base URL minus ``/v1``."""
        client = state.get("client")
        base_url = getattr(getattr(client, "client", None), "base_url", None)
        if base_url is None:
            base_url = getattr(getattr(client, "config", None), "api_base_url", None)
        return self.gateway_settings.resolve_gateway_url(
            base_url, how_to_set="set gateway={'gateway_url': ...} on the env"
        )

    # ------------------------------------------- overridable steps (earlier signatures)

    async def register_rollout(self, state: State) -> None:
        """Register the rollout with the gateway (model, sampling params, limits)."""
        rollout = self._core(state)
        await rollout.register(
            model=state["model"],
            sampling_params=self.gateway_sampling_params(state),
            max_turns=self.max_turns if self.max_turns > 0 else protocol.UNLIMITED_TURNS,
            max_seq_len=self.max_seq_len,
        )
        self._gateway_rollouts.keep(rollout)

    def gateway_sampling_params(self, state: State) -> dict[str, Any]:
        """Sampling params registered for the rollout: the env's, then the rollout's.

        ``n`` is dropped: verifiers' ``n`` is the number of rollouts, each its own agent.
        """
        params = protocol.flatten_sampling_args(
            getattr(self, "sampling_args", None), state.get("sampling_args")
        )
        params.pop("n", None)
        return params

    async def unregister_rollout(self, state: State) -> None:
        """Unregister the rollout (runs once per rollout, from the core's finalize)."""
        rollout = self._core(state)
        try:
            await rollout.unregister()
        finally:
            self._gateway_rollouts.forget(rollout)

    async def cancel_rollout(self, state: State) -> None:
        """Cancel the rollout at the gateway (best effort): its later turns are refused."""
        await self._core(state).cancel()

    async def get_gateway_tunnel_url(self, local_addr: str | None = None) -> str:
        """Public root URL of the gateway at ``local_addr`` (one shared tunnel per host).

        Inside a rollout: the rollout's gateway host (the tunnel it leases), or another
        ``local_addr`` on the same port and scheme. Outside one (an env's own setup, after
        its rollouts), as the earlier mixin: the tunnel of ``local_addr`` on
        ``gateway_port``, started if needed; without ``local_addr``, the one tunnel open
        (or the configured ``gateway_url``'s); ``ValueError`` when that is ambiguous.
        """
        ref = current_rollout.get()
        rollout = ref() if ref is not None else None
        tunnels = self.gateway_resources().tunnels
        if rollout is None:
            return await shared_tunnel_url(tunnels, self.gateway_settings, local_addr)
        gateway_url = rollout.record.gateway_url or ""
        if local_addr not in (None, protocol.gateway_host(gateway_url)):
            port = self.gateway_settings.gateway_port
            scheme = gateway_url.split("://", 1)[0] or "http"
            return await tunnels.get_url(f"{scheme}://{local_addr}:{port}")
        await rollout.lease_tunnel()
        assert rollout.record.tunnel_url is not None
        return rollout.record.tunnel_url

    # The earlier mixin's public attributes, set by init_gateway there (settings here).

    @property
    def gateway_port(self) -> int:
        """The gateway's port when its URL names none (``GatewaySettings.gateway_port``)."""
        return self.gateway_settings.gateway_port

    @gateway_port.setter
    def gateway_port(self, port: int) -> None:
        self.init_gateway(gateway_port=port)

    @property
    def gateway_timeout_seconds(self) -> float | None:
        """Seconds an agent may run (``GatewaySettings.agent_timeout``; ``None``: no limit)."""
        return self.gateway_settings.agent_timeout

    @gateway_timeout_seconds.setter
    def gateway_timeout_seconds(self, seconds: float | None) -> None:
        self.init_gateway(timeout_seconds=seconds)

    #: The earlier mixin's own (private) name of the agent timeout.
    _gateway_timeout_seconds = gateway_timeout_seconds

    async def fetch_trajectory(self, state: State) -> None:
        """Fetch the trajectory and write it into the state (see :mod:`.trajectory`)."""
        answer = await self._core(state).fetch_trajectory()
        steps = apply_trajectory(state, answer)
        for step in steps:
            self.increment_state_usage_from_response(state, step["response"])
        tools = recorded_tools(steps)
        if tools:  # the agent's tools, as CliAgentEnv takes them from intercepted requests
            state["tool_defs"] = self.normalize_intercepted_tools(tools)

    # ------------------------------------------------------------------ the rollout

    # verifiers marks MultiTurnEnv.rollout @final and offers no hook that replaces its
    # model loop, so gateway mode overrides it; interception mode calls it unchanged.
    async def rollout(
        self,
        input: RolloutInput,
        client: Any,
        model: str,
        sampling_args: SamplingArgs | None = None,
    ) -> State:
        """Run one rollout; in gateway mode nothing but cancellation escapes."""
        if not self.use_gateway:
            return await super().rollout(input, client, model, sampling_args)
        state = await self._init_state_or_error(input, client, model, sampling_args)
        resources = self._gateway_owner.acquire()
        try:
            await self._gateway_rollout(state, resources)
        finally:
            await self._gateway_owner.release(resources)
        return state

    async def _gateway_rollout(self, state: State, resources: GatewayResources) -> None:
        rollout = self._new_rollout(None, resources)
        state["rollout_id"] = rollout.rollout_id
        if state.get("error") is not None:
            rollout.fail(state["error"])
        hooks = ClassicHooks(rollout, self, state)
        try:
            with self._gateway_rollouts.running(rollout):
                state["timing"].generation.start = state["timing"].setup.start = time.time()
                try:
                    url = self.resolve_gateway_url(state)
                    rollout.record.gateway_url = state["gateway_url"] = url
                except GatewayConfigError as e:
                    rollout.fail(e)
                if rollout.record.error is not None:
                    await rollout.run_finalize(hooks)
                else:
                    await rollout.execute(hooks, timeout=self.timeout_seconds)
        finally:
            hooks.render_outcome()

    async def _init_state_or_error(
        self, input: RolloutInput, client: Any, model: str, sampling_args: SamplingArgs | None
    ) -> State:
        """``init_state``; a malformed row becomes a typed error on an empty state."""
        try:
            return await self.init_state(input, client, model, sampling_args)
        except Exception as e:
            blank = {**input, "prompt": [], "info": {}}
            state = await self.init_state(blank, client, model, sampling_args)
            state["error"] = RolloutInputError(f"malformed input row: {type(e).__name__}: {e}")
            return state

    # ------------------------------------------------------------------ verifiers hooks

    async def render_completion(self, state: State) -> None:
        """Use the gateway's ``completion`` when it sent one."""
        if self.use_gateway and state.get("gateway_completion") is not None:
            state["completion"] = state["gateway_completion"]
            return
        await super().render_completion(state)

    @vf.teardown(priority=10)
    async def teardown_gateway(self) -> None:
        """End rollouts in flight, close the control-plane clients, stop every tunnel.

        Rollouts started afterwards still run, on resources closed when the last of them
        ends: none is left open with nothing to close it."""
        self._gateway_rollouts.clear()
        await self._gateway_owner.teardown()


__all__ = ["SANDBOX_BACKEND_ENV", "RolloutGatewayMixin"]
