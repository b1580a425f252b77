"""The taskset's env: the single-agent env with the ``gateway`` interception type."""

from __future__ import annotations

from rollout_gateway.v1 import GatewayEnv


class FixBugEnv(GatewayEnv):
    """One agent per task; ``--env.interception.type gateway`` selects gateway mode."""
