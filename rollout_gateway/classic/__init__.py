"""The verifiers 0.3 stack: ``RolloutGatewayMixin`` for ``vf.CliAgentEnv``.

Importing this package imports verifiers 0.3; the core (:mod:`rollout_gateway`) does not.
"""

from rollout_gateway.verifiers_stack import CLASSIC, require_stack

# Before any verifiers import, which fails on verifiers 0.4 (no verifiers.types): name
# the extra to install instead.
require_stack(CLASSIC, "rollout_gateway.classic (RolloutGatewayMixin)")

from rollout_gateway.classic.mixin import RolloutGatewayMixin

__all__ = ["RolloutGatewayMixin"]
