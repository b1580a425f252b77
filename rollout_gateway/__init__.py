"""rollout-gateway: gateway-mode rollouts for verifiers environments.

Public API, imported lazily: the core (settings, lifecycle, client, tunnels, errors,
server) imports neither verifiers nor openai; ``RolloutGatewayMixin`` imports the
verifiers 0.3 stack when first used::

    from rollout_gateway import RolloutGatewayMixin, GatewaySettings, GatewayRollout
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "RolloutGatewayMixin": "rollout_gateway.classic.mixin",
    "GatewaySettings": "rollout_gateway.settings",
    "GatewayRollout": "rollout_gateway.lifecycle",
    "RolloutHooks": "rollout_gateway.lifecycle",
    "RolloutRecord": "rollout_gateway.lifecycle",
    "AgentExit": "rollout_gateway.lifecycle",
    "GatewayResources": "rollout_gateway.resources",
    "GatewayClient": "rollout_gateway.client",
    "RetryPolicy": "rollout_gateway.client",
    "TunnelProvider": "rollout_gateway.tunnels",
    "PrimeTunnelProvider": "rollout_gateway.tunnels",
    "DirectTunnelProvider": "rollout_gateway.tunnels",
    "TunnelPool": "rollout_gateway.tunnels",
    "PollPolicy": "rollout_gateway.polling",
    "LocalSandboxClient": "rollout_gateway.local_sandbox",
    "AgentCrashError": "rollout_gateway.errors",
    "AgentPollError": "rollout_gateway.errors",
    "AgentStartError": "rollout_gateway.errors",
    "EmptyTrajectoryError": "rollout_gateway.errors",
    "EngineError": "rollout_gateway.errors",
    "GatewayConfigError": "rollout_gateway.errors",
    "GatewayError": "rollout_gateway.errors",
    "GatewayProtocolError": "rollout_gateway.errors",
    "GatewayRequestError": "rollout_gateway.errors",
    "GatewayTunnelError": "rollout_gateway.errors",
    "GatewayUnavailableError": "rollout_gateway.errors",
    "PostRolloutError": "rollout_gateway.errors",
    "RolloutConflictError": "rollout_gateway.errors",
    "RolloutGatewayError": "rollout_gateway.errors",
    "RolloutInfraError": "rollout_gateway.errors",
    "RolloutInputError": "rollout_gateway.errors",
    "RolloutNotFoundError": "rollout_gateway.errors",
    "SandboxError": "rollout_gateway.errors",
}

__all__ = [
    "__version__",
    "RolloutGatewayMixin",
    "GatewaySettings",
    "GatewayRollout",
    "RolloutHooks",
    "RolloutRecord",
    "AgentExit",
    "GatewayResources",
    "GatewayClient",
    "RetryPolicy",
    "TunnelProvider",
    "PrimeTunnelProvider",
    "DirectTunnelProvider",
    "TunnelPool",
    "PollPolicy",
    "LocalSandboxClient",
    "AgentCrashError",
    "AgentPollError",
    "AgentStartError",
    "EmptyTrajectoryError",
    "EngineError",
    "GatewayConfigError",
    "GatewayError",
    "GatewayProtocolError",
    "GatewayRequestError",
    "GatewayTunnelError",
    "GatewayUnavailableError",
    "PostRolloutError",
    "RolloutConflictError",
    "RolloutGatewayError",
    "RolloutInfraError",
    "RolloutInputError",
    "RolloutNotFoundError",
    "SandboxError",
]

if TYPE_CHECKING:
    from rollout_gateway.classic.mixin import (
        RolloutGatewayMixin,
    )
    from rollout_gateway.client import (
        GatewayClient,
        RetryPolicy,
    )
    from rollout_gateway.errors import (
        AgentCrashError,
        AgentPollError,
        AgentStartError,
        EmptyTrajectoryError,
        EngineError,
        GatewayConfigError,
        GatewayError,
        GatewayProtocolError,
        GatewayRequestError,
        GatewayTunnelError,
        GatewayUnavailableError,
        PostRolloutError,
        RolloutConflictError,
        RolloutGatewayError,
        RolloutInfraError,
        RolloutInputError,
        RolloutNotFoundError,
        SandboxError,
    )
    from rollout_gateway.lifecycle import (
        AgentExit,
        GatewayRollout,
        RolloutHooks,
        RolloutRecord,
    )
    from rollout_gateway.local_sandbox import (
        LocalSandboxClient,
    )
    from rollout_gateway.polling import (
        PollPolicy,
    )
    from rollout_gateway.resources import (
        GatewayResources,
    )
    from rollout_gateway.settings import (
        GatewaySettings,
    )
    from rollout_gateway.tunnels import (
        DirectTunnelProvider,
        PrimeTunnelProvider,
        TunnelPool,
        TunnelProvider,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout_gateway' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
