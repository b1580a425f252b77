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
:class:`~rollout_gateway.v1.LocalSandboxRuntime`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_config import BaseConfig

from rollout_gateway.v1.internals import (
    ApptainerConfig,
    BaseInterceptionConfig,
    BaseRuntimeInfo,
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


#: The isolation modes of the local sandboxes (``rollout_gateway.local_sandbox``), and
#: ``auto``: the strongest this host offers (never ``process-group``).
IsolationChoice = Literal["auto", "bwrap", "unshare", "uid", "process-group"]


class LocalSandboxRuntimeConfig(BaseConfig):
    """Run the harness in a contained local sandbox (``rollout_gateway.local_sandbox``).

    The same isolation modes and guarantees as the classic stack's local backend: a
    private working directory (``HOME``) and temp directory as the only writable places,
    its own uid on root hosts, no host environment, and enforced process, memory and
    disk limits where the host offers them (``rollout-gateway demo --help`` lists them).
    The network is the host's (agents reach the gateway over loopback). The task's
    ``resources`` (``cpu``, ``memory``, ``disk``) apply unless set here.
    """

    type: Literal["local_sandbox"] = "local_sandbox"
    isolation: IsolationChoice = "auto"
    """``auto`` (the strongest this host offers), ``bwrap``, ``unshare``, ``uid``, or
    ``process-group`` (no containment: explicit opt-in, with a warning)."""
    root: str | None = None
    """Directory holding the sandboxes (default ``$ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT`` or
    ``<temp dir>/rollout-gateway-sandboxes``)."""
    cpu: float | None = Field(None, gt=0)
    """CPU cores (CPU-time bound of each command; a CPU quota where the host offers
    cgroups). None: one core."""
    memory: float = Field(2.0, gt=0)
    """Memory in GB, for the whole sandbox."""
    disk: float = Field(5.0, gt=0)
    """Disk in GB: everything the sandbox writes (working and temp directories)."""
    pids: int = Field(1024, gt=0)
    """Processes (and threads) the sandbox may have at once."""
    image: str | None = None
    """A local image seeding the working directory: ``local:<dir or .tar[.gz]>``,
    ``dir:<dir>`` or an absolute path. A container image name is refused (a local
    sandbox runs the host's programs: use the docker or prime runtime for images)."""
    timeout_minutes: float = Field(24 * 60, gt=0)
    """Longest lifetime of one sandbox; past it the sandbox is killed and removed (v1's
    own timeouts bound the agent first)."""

    @field_validator("image")
    @classmethod
    def _local_image(cls, image: str | None) -> str | None:
        from rollout_gateway.local_sandbox.seeding import local_image_path

        if image is not None and local_image_path(image) is None:
            raise ValueError(
                f"the local_sandbox runtime cannot run container image {image!r}: it runs "
                "the host's programs (use the docker or prime runtime for images, or a "
                "local image: local:<directory or .tar>)"
            )
        return image


class LocalSandboxRuntimeInfo(LocalSandboxRuntimeConfig, BaseRuntimeInfo):
    """What a trace records about the local sandbox its rollout ran in (``id``: the
    sandbox id)."""


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
