"""rollout-gateway: gateway-mode rollouts for verifiers environments.

Each rollout's CLI agent runs in its own sandbox and talks to the inference server's
rollout gateway, which records its trajectory token by token; the env runs only the
lifecycle. Documentation: the ``docs/`` site of the source tree (and the README).

Public API (``__all__``; imported lazily, so ``import rollout_gateway`` stays light):

Adapters
    ``RolloutGatewayMixin``: gateway mode for verifiers 0.3's ``vf.CliAgentEnv``
    (``rollout-gateway[classic]``). For verifiers 0.4 see :mod:`rollout_gateway.v1`
    (``rollout-gateway[v1]``). The two extras exclude each other.
The lifecycle core (no verifiers import)
    ``GatewaySettings`` (one settings object), ``GatewayRollout`` (one rollout's
    stages and its one finalize path), ``RolloutHooks``, ``RolloutRecord``,
    ``AgentExit``, ``GatewayResources`` (clients, tunnels, rollouts in flight),
    ``PollPolicy``.
The control-plane client
    ``GatewayClient``, ``RetryPolicy``.
Tunnels
    ``TunnelProvider``, ``PrimeTunnelProvider``, ``DirectTunnelProvider``, ``TunnelPool``.
Local sandboxes
    ``LocalSandboxClient`` (prime-sandboxes' client, on this machine, contained).
Errors (:mod:`rollout_gateway.errors`)
    ``RolloutGatewayError`` and its family: ``GatewayConfigError``
    (``GatewayAuthError``), ``RolloutInfraError`` (``GatewayError``, ``SandboxError``...),
    ``AgentCrashError``.

Subpackages with their own public API: :mod:`rollout_gateway.server` (the reference
gateway), :mod:`rollout_gateway.scripted` (the scripted model),
:mod:`rollout_gateway.protocol`, :mod:`rollout_gateway.testing` (fakes for tests),
:mod:`rollout_gateway.local_sandbox`, :mod:`rollout_gateway.v1`.

``dir(rollout_gateway)`` lists the exports this installation can import (not
``RolloutGatewayMixin`` without verifiers 0.3); importing one that needs another extra
raises an ``ImportError`` naming it.
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
    "GatewayAuthError": "rollout_gateway.errors",
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
    "GatewayAuthError",
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
        GatewayAuthError,
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


#: Exports that need an extra, and how to tell whether this installation has it.
_NEEDS_CLASSIC = frozenset({"RolloutGatewayMixin"})
_NEEDS_PRIME_SANDBOXES = frozenset({"LocalSandboxClient"})


def _available(name: str) -> bool:
    """Whether export ``name`` can be imported in this installation (metadata only)."""
    if name in _NEEDS_CLASSIC:
        from rollout_gateway.verifiers_stack import CLASSIC, installed_stack

        return installed_stack() == CLASSIC
    if name in _NEEDS_PRIME_SANDBOXES:
        import importlib.util

        return importlib.util.find_spec("prime_sandboxes") is not None
    return True


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout_gateway' has no attribute {name!r}")
    if not _available(name):
        from rollout_gateway.verifiers_stack import CLASSIC, wrong_stack_error

        if name in _NEEDS_CLASSIC:
            raise wrong_stack_error(CLASSIC, f"rollout_gateway.{name}")
        raise ImportError(
            f"rollout_gateway.{name} needs prime-sandboxes (its request, answer and error "
            "types), which comes with either verifiers stack: pip install "
            "'rollout-gateway[v1]' (or 'rollout-gateway[classic]')"
        )
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    # The exports this installation can import, beside the module's own names: help()
    # and tab completion show the public API without failing on another stack's adapter.
    dunders = (name for name in globals() if name.startswith("__"))
    return sorted({*dunders, *(name for name in __all__ if _available(name))})
