"""Gateway mode for verifiers v1 (``verifiers>=0.4``): install ``rollout-gateway[v1]``.

- :class:`GatewayInterception`: v1's ``Interception`` served by the rollout gateway
  (``vf.Agent(config, interception=gi)``, plus :func:`gateway_synced_agent`).
- :class:`GatewayEnvMixin`, :class:`GatewayEnv`, :class:`GatewayEnvConfig`: the
  ``gateway`` interception type of an env's config (``--env.interception.type gateway``).
- :class:`GatewayInterceptionConfig`, :data:`InterceptionChoice`: the config block.
- Errors and stops are v1's own (:mod:`.errors`, :mod:`.stops`): ``InterceptionError`` /
  ``TunnelError`` for the gateway, ``ProviderError`` for the engine behind it,
  ``TaskError`` for a task whose hooks need the env on every turn
  (:class:`GatewayFeatureError` at ``serving()``); the gateway's limits under v1's names.
- Versions: :data:`SUPPORTED_VERIFIERS`, checked on import
  (:class:`UnsupportedVerifiersError`); every v1 internal used is in :mod:`.internals`
  (the demo's eval-only ones in :mod:`.eval_internals`), every private one in its table
  (``internals.PRIVATE``). Importing changes nothing in v1; :func:`install` makes the one
  change (the ``local_sandbox`` entry of v1's runtime table), and a
  :class:`LocalSandboxRuntimeConfig` calls it when it is made.
- :class:`LocalSandboxRuntime`, :class:`LocalSandboxRuntimeConfig`: the ``local_sandbox``
  runtime type (``--env.agent.runtime.type local_sandbox``), contained local sandboxes
  for v1 agents; :data:`RuntimeChoice` and :class:`LocalSandboxAgentConfig` accept it in
  configs; :func:`check_local_sandbox` fails fast when this host cannot run them
  (:class:`LocalSandboxStartError`, a v1 ``SandboxError``); :func:`record_for_v1` records
  a local-sandbox trace in v1's own vocabulary (v1's trace readers accept no other
  runtime type; the gateway env applies it to every episode), :func:`local_sandbox_record`
  reads the full record back.
- :func:`agent_environment`: what a harness gives its program to reach the rollout with
  the OpenAI or the Anthropic client (Claude Code), from v1's ``endpoint`` and ``secret``.
"""

from rollout_gateway.verifiers_stack import V1, require_stack

# Before any verifiers.v1 import, which fails on verifiers 0.3 with a message about
# verifiers' internals: name the extra to install instead. (Then every module here imports
# verifiers through .internals, whose import checks the version within the v1 stack.)
require_stack(V1, "rollout_gateway.v1")

from rollout_gateway.v1.agent_env import agent_environment
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
from rollout_gateway.v1.errors import GatewayFeatureError, feature_error, interception_error
from rollout_gateway.v1.harness_sync import gateway_synced, gateway_synced_agent
from rollout_gateway.v1.interception import GatewayInterception
from rollout_gateway.v1.internals import (
    SUPPORTED_VERIFIERS,
    TESTED_VERIFIERS,
    UnsupportedVerifiersError,
)
from rollout_gateway.v1.runtime import (
    LocalSandboxRuntime,
    LocalSandboxStartError,
    check_local_sandbox,
    install,
)
from rollout_gateway.v1.runtime_record import local_sandbox_record, record_for_v1
from rollout_gateway.v1.stops import ADAPTER_STOPS, REFUSAL_STOPS, TRUNCATION_STOPS
from rollout_gateway.v1.trace_sync import TraceSync

__all__ = [
    "ADAPTER_STOPS",
    "DEFAULT_ADMIN_TOKEN_VAR",
    "REFUSAL_STOPS",
    "SUPPORTED_VERIFIERS",
    "TESTED_VERIFIERS",
    "TRUNCATION_STOPS",
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
    "UnsupportedVerifiersError",
    "agent_environment",
    "feature_error",
    "check_local_sandbox",
    "gateway_synced",
    "gateway_synced_agent",
    "install",
    "interception_error",
    "local_sandbox_record",
    "record_for_v1",
]
