"""Typed errors of rollout-gateway.

Every infrastructure failure is a ``vf.InfraError`` (or one of verifiers' subclasses:
``vf.TunnelError``, ``vf.SandboxError``) so a trainer reschedules the rollout instead of
giving it a zero reward. Only :class:`GatewayConfigError` signals a mistake of the env
author, and it is raised before any resource is created.
"""

from __future__ import annotations

import verifiers as vf


class GatewayConfigError(vf.Error, ValueError):
    """The env is misconfigured for gateway mode (e.g. no usable gateway URL)."""


class GatewayError(vf.InfraError):
    """A call to the rollout gateway's control plane failed.

    ``status_code`` is the HTTP status the gateway answered with, or ``None`` when no
    answer came (connection error, timeout). ``retryable`` tells whether the failure was
    of a transient kind (it may still have been retried already).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        rollout_id: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.rollout_id = rollout_id
        self.retryable = retryable


class GatewayUnavailableError(GatewayError):
    """The gateway could not be reached or kept answering 429/502/503/504."""


class GatewayRequestError(GatewayError):
    """The gateway rejected a request (a 4xx other than 429); not retried."""


class RolloutNotFoundError(GatewayRequestError):
    """The gateway does not know the rollout (404)."""


class RolloutConflictError(GatewayRequestError):
    """The gateway refused because of the rollout's state (409: already registered...)."""


class GatewayProtocolError(GatewayError):
    """The gateway answered with a body that does not follow the protocol."""


class GatewayTunnelError(vf.TunnelError):
    """A tunnel to the gateway could not be started or died."""


class AgentStartError(vf.SandboxError):
    """The agent's background job could not be started in the sandbox."""


class AgentPollError(vf.SandboxError):
    """Polling the agent's background job kept failing."""


class PostRolloutError(vf.InfraError):
    """The env's ``post_rollout`` hook failed (e.g. the sandbox check could not run)."""


class EmptyTrajectoryError(vf.InfraError):
    """The agent exited without a single model call: nothing to train on.

    Treated as infrastructure (the agent could not reach the model, crashed at start...)
    so its zero reward does not skew its group's advantages. Set
    ``allow_empty_trajectory = True`` on the env to keep such rollouts as zero-turn ones.
    """


__all__ = [
    "AgentPollError",
    "AgentStartError",
    "EmptyTrajectoryError",
    "GatewayConfigError",
    "GatewayError",
    "GatewayProtocolError",
    "GatewayRequestError",
    "GatewayTunnelError",
    "GatewayUnavailableError",
    "PostRolloutError",
    "RolloutConflictError",
    "RolloutNotFoundError",
]
