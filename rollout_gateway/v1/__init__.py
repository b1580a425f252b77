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
  (:class:`UnsupportedVerifiersError`); every v1 internal used is in :mod:`.internals`.
"""

# Every module here imports verifiers through .internals, whose import checks the version.
from rollout_gateway.v1.config import (
    DEFAULT_ADMIN_TOKEN_VAR,
    GatewayInterceptionConfig,
    InterceptionChoice,
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
    "TraceSync",
    "UnsupportedVerifiersError",
    "feature_error",
    "gateway_synced",
    "gateway_synced_agent",
    "interception_error",
]
