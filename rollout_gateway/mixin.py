"""Where 0.1 imported the mixin from; it lives in :mod:`rollout_gateway.classic` now."""

from rollout_gateway.classic.mixin import SANDBOX_BACKEND_ENV, RolloutGatewayMixin
from rollout_gateway.lifecycle import PLACEHOLDER_API_KEY
from rollout_gateway.settings import ADMIN_TOKEN_ENV

__all__ = ["ADMIN_TOKEN_ENV", "PLACEHOLDER_API_KEY", "SANDBOX_BACKEND_ENV", "RolloutGatewayMixin"]
