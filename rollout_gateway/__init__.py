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

# The public API: these imports. Type checkers read them; at run time they are read from
# this file (``_exports``), and each name is imported when first used.
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


def _exports() -> dict[str, str]:
    """Each public name and its module: the ``TYPE_CHECKING`` imports above (read once)."""
    global _EXPORTS
    if _EXPORTS is None:
        import ast
        from pathlib import Path

        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
        block = next(
            n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
        )
        _EXPORTS = {
            alias.name: node.module
            for node in block.body
            if isinstance(node, ast.ImportFrom) and node.module is not None
            for alias in node.names
        }
    return _EXPORTS


_EXPORTS: dict[str, str] | None = None

#: The names above (a literal: the API reference's generator reads it without running
#: the module; tests/test_public_api.py checks that it names every import above).
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
    module = _exports().get(name)
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
    return sorted({*dunders, *(name for name in _exports() if _available(name))})
