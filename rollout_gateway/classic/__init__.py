"""The verifiers 0.3 stack: ``RolloutGatewayMixin`` for ``vf.CliAgentEnv``.

Importing this package imports verifiers 0.3; the core (:mod:`rollout_gateway`) does not.
"""

from rollout_gateway.classic.mixin import RolloutGatewayMixin

__all__ = ["RolloutGatewayMixin"]
