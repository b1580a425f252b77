"""The ``gateway`` interception type and the ``local_sandbox`` runtime type for verifiers
v1 configs.

v1 picks an env's interception from ``[env.interception]`` (a pydantic union
discriminated on ``type``: ``server | static | elastic``). :data:`InterceptionChoice` is
that union plus :class:`GatewayInterceptionConfig`, so an env config annotated with it
accepts ``--env.interception.type gateway`` (TOML: ``[env.interception] type = "gateway"``)
and still every built-in type.

Runtimes the same way: v1's ``RuntimeConfig`` is a closed union discriminated on ``type``
(``subprocess | docker | podman | apptainer | prime | modal | e2b``). :data:`RuntimeChoice`
adds :class:`LocalSandboxRuntimeConfig`, and :class:`LocalSandboxAgentConfig` is v1's
``AgentConfig`` whose ``runtime`` is that choice, so ``--env.agent.runtime.type
local_sandbox`` (TOML: ``[env.agent.runtime] type = "local_sandbox"``) selects
:class:`~rollout_gateway.v1.LocalSandboxRuntime` (its config is defined beside it, in
:mod:`rollout_gateway.v1.runtime`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from rollout_gateway.v1.internals import (
    ApptainerConfig,
    BaseInterceptionConfig,
    DockerConfig,
    E2BConfig,
    ElasticInterceptionPoolConfig,
    InterceptionServerConfig,
    ModalConfig,
    PodmanConfig,
    PrimeConfig,
    StaticInterceptionPoolConfig,
    SubprocessConfig,
    vf,
)
from rollout_gateway.v1.runtime import (
    IsolationChoice,
    LocalSandboxRuntimeConfig,
    LocalSandboxRuntimeInfo,
)

#: Environment variable holding the gateway's control-plane token, by default.
DEFAULT_ADMIN_TOKEN_VAR = "ROLLOUT_GATEWAY_ADMIN_TOKEN"


class GatewayInterceptionConfig(BaseInterceptionConfig):
    """Serve the agents' model calls from the inference server's rollout gateway."""

    type: Literal["gateway"] = "gateway"
    url: str | None = None
    """Gateway root (``http://host:port``). Default: the run's client ``base_url``
    without ``/v1`` (the inference URL prime-rl sends)."""
    tunnel: Literal["auto", "prime", "direct"] = "auto"
    """How agents reach the gateway: ``prime`` (one shared prime tunnel per gateway
    host), ``direct`` (the gateway URL as is: same network, or local runtimes), or
    ``auto``: ``direct`` when every runtime is local, else ``prime``."""
    port: int = Field(8000, gt=0, lt=65536)
    """Gateway port when its URL names none."""
    admin_token_var: str = DEFAULT_ADMIN_TOKEN_VAR
    """Environment variable holding the control-plane bearer token (unset: none)."""
    max_seq_len: int | None = Field(None, ge=1)
    """Context bound registered with each rollout (``is_truncated`` past it)."""
    fallback: bool = False
    """Run tasks whose hooks need the env on every model call (``@intercept``,
    per-turn ``@stop``, tool gating, tool servers on ``/state``) through verifiers' own
    interception instead of refusing them."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"gateway url must be http(s), got {url!r}")
        return url


#: v1's interception union plus ``gateway``: annotate an env config's ``interception`` with it.
InterceptionChoice = Annotated[
    InterceptionServerConfig
    | StaticInterceptionPoolConfig
    | ElasticInterceptionPoolConfig
    | GatewayInterceptionConfig,
    Field(discriminator="type"),
]


#: v1's runtime union plus ``local_sandbox``: annotate an agent config's ``runtime`` with it.
RuntimeChoice = Annotated[
    SubprocessConfig
    | DockerConfig
    | PodmanConfig
    | ApptainerConfig
    | PrimeConfig
    | ModalConfig
    | E2BConfig
    | LocalSandboxRuntimeConfig,
    Field(discriminator="type"),
]


class LocalSandboxAgentConfig(vf.AgentConfig):
    """v1's ``AgentConfig`` whose ``runtime`` also accepts ``type = "local_sandbox"``."""

    runtime: RuntimeChoice = PrimeConfig()


__all__ = [
    "DEFAULT_ADMIN_TOKEN_VAR",
    "GatewayInterceptionConfig",
    "InterceptionChoice",
    "IsolationChoice",
    "LocalSandboxAgentConfig",
    "LocalSandboxRuntimeConfig",
    "LocalSandboxRuntimeInfo",
    "RuntimeChoice",
]
