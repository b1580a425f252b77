"""Typed errors of rollout-gateway, independent of any verifiers version.

Every failure of a rollout ends as exactly one error on the rollout's record. The
classes here say *what* failed; each stack adapter maps them onto its own error model
(verifiers 0.3: the ``vf.InfraError`` family, see :mod:`rollout_gateway.classic.errors`;
verifiers v1: its own error types), so a trainer can tell infrastructure failures, which
it reschedules, from the model's own failures, which it trains on.

- :class:`GatewayConfigError`: a mistake of the env author, raised before any resource
  exists; no retry of the rollout can fix it. :class:`GatewayAuthError` is one: the
  gateway refused the env's admin token.
- :class:`RolloutInfraError` and subclasses: infrastructure failed; retrying the rollout
  elsewhere may succeed.
- :class:`EngineError`: the engine behind the gateway failed the agent's model calls
  and the agent then exited (an inference outage, distinct from an agent crash).
- :class:`AgentCrashError`: the agent exited non-zero before the rollout ended on its
  own. Whether a trainer reschedules such a rollout is its stack's call: verifiers 0.3
  counts an agent crash as infrastructure (its ``AgentError`` is an ``InfraError``), and
  the 0.3 mixin raises it as both; verifiers v1 judges a harness's exit itself, so the v1
  adapter never raises it.
"""

from __future__ import annotations


class RolloutGatewayError(Exception):
    """Base class of every error this package raises."""


class GatewayConfigError(RolloutGatewayError, ValueError):
    """The env is misconfigured for gateway mode (e.g. no usable gateway URL)."""


class GatewayAuthError(GatewayConfigError):
    """The gateway refused the env's admin token (401 or 403 on a control-plane call).

    A configuration error, not infrastructure: the env sent no token, or not the one the
    gateway was started with, and retrying cannot help. The message names the setting
    to fix. ``status_code`` is the gateway's answer; ``gateway_url`` the gateway's root.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        gateway_url: str | None = None,
        rollout_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.gateway_url = gateway_url
        self.rollout_id = rollout_id


class RolloutInfraError(RolloutGatewayError):
    """Infrastructure failed during a rollout: the trainer should reschedule it."""


class GatewayError(RolloutInfraError):
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


class GatewayTunnelError(RolloutInfraError):
    """A tunnel to the gateway could not be started, or died while a rollout used it."""


class SandboxError(RolloutInfraError):
    """The sandbox could not be created, set up, or deleted."""


class AgentStartError(SandboxError):
    """The agent's process could not be started in the sandbox."""


class AgentPollError(SandboxError):
    """Asking the sandbox whether the agent has exited kept failing."""


class PostRolloutError(RolloutInfraError):
    """The env's sandbox-side scoring hook (``post_rollout``) failed."""


class EmptyTrajectoryError(RolloutInfraError):
    """The agent exited without a single model call: nothing to train on.

    Treated as infrastructure (the agent could not reach the model, crashed at start...)
    so its zero reward does not skew its group's advantages. Set
    ``allow_empty_trajectory`` to keep such rollouts as zero-turn ones.
    """


class RolloutInputError(RolloutInfraError):
    """The rollout's input row is malformed (unknown message role, ``info`` not JSON...).

    Infrastructure from the trainer's point of view: the data, not the policy, failed.
    """


class EngineError(RolloutInfraError):
    """The inference engine behind the gateway failed the agent's model calls
    (unreachable, 5xx, timeout: the gateway's ``failed_turns``), and the agent then
    exited: an outage, not the agent's crash nor the policy's failure. Each stack gives it
    its own engine-error type too (verifiers 0.3: ``vf.ModelError``; v1: ``ProviderError``)."""


class AgentCrashError(RolloutGatewayError):
    """The agent exited with a non-zero code (see the module docstring for how each
    stack treats it; on verifiers 0.3 it is also verifiers' ``AgentError``)."""


__all__ = [
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
