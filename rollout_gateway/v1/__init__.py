"""Gateway mode for verifiers v1 (``verifiers>=0.4``): install ``rollout-gateway[v1]``.

- :class:`GatewayInterception`: v1's ``Interception`` served by the rollout gateway
  (``vf.Agent(config, interception=gi)``, plus :func:`gateway_synced_agent`).
- :class:`GatewayEnvMixin`, :class:`GatewayEnv`, :class:`GatewayEnvConfig`: the
  ``gateway`` interception type of an env's config (``--env.interception.type gateway``).
- :class:`GatewayInterceptionConfig`, :data:`InterceptionChoice`: the config block.
- Errors: gateway failures are v1's own ``InterceptionError`` / ``TunnelError``;
  :class:`GatewayFeatureError` (a ``TaskError``) refuses tasks with per-turn env hooks.
- :class:`LocalSandboxRuntime`, :class:`LocalSandboxRuntimeConfig`: the ``local_sandbox``
  runtime type (``--env.agent.runtime.type local_sandbox``), contained local sandboxes
  for v1 agents; :data:`RuntimeChoice` and :class:`LocalSandboxAgentConfig` accept it in
  configs; :func:`check_local_sandbox` fails fast when this host cannot run them
  (:class:`LocalSandboxStartError`, a v1 ``SandboxError``).
"""

from rollout_gateway.verifiers_stack import V1, require_stack

# Before any verifiers.v1 import, which fails on verifiers 0.3 with a message about
# verifiers' internals: name the extra to install instead.
require_stack(V1, "rollout_gateway.v1")

from rollout_gateway.v1.config import (
    DEFAULT_ADMIN_TOKEN_VAR,
    GatewayInterceptionConfig,
    InterceptionChoice,
    IsolationChoice,
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
    LocalSandboxRuntimeInfo,
    RuntimeChoice,
)
from rollout_gateway.v1.env import GatewayEnv, GatewayEnvConfig, GatewayEnvMixin
from rollout_gateway.v1.errors import GatewayFeatureError, interception_error
from rollout_gateway.v1.harness_sync import gateway_synced, gateway_synced_agent
from rollout_gateway.v1.interception import GatewayInterception
from rollout_gateway.v1.runtime import (
    LocalSandboxRuntime,
    LocalSandboxStartError,
    check_local_sandbox,
)
from rollout_gateway.v1.trace_sync import TraceSync

__all__ = [
    "DEFAULT_ADMIN_TOKEN_VAR",
    "GatewayEnv",
    "GatewayEnvConfig",
    "GatewayEnvMixin",
    "GatewayFeatureError",
    "GatewayInterception",
    "GatewayInterceptionConfig",
    "InterceptionChoice",
    "IsolationChoice",
    "LocalSandboxAgentConfig",
    "LocalSandboxRuntime",
    "LocalSandboxRuntimeConfig",
    "LocalSandboxRuntimeInfo",
    "LocalSandboxStartError",
    "RuntimeChoice",
    "TraceSync",
    "check_local_sandbox",
    "gateway_synced",
    "gateway_synced_agent",
    "interception_error",
]
