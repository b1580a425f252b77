"""``--env.id rollout-gateway-env``: verifiers v1's single-agent env with the gateway type.

verifiers v1 loads an env by id from a top-level module exporting one ``Env`` subclass
(a dotted id would not load), so this module re-exports
:class:`rollout_gateway.v1.GatewayEnv`. Needs ``rollout-gateway[v1]``.
"""

from rollout_gateway.v1.env import GatewayEnv

__all__ = ["GatewayEnv"]
