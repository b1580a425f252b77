"""Gateway failures as verifiers v1 errors.

v1 attributes every rollout failure to the boundary it crossed (``verifiers.v1.errors``).
Gateway mode replaces v1's interception server, so a failing gateway is an
*interception* failure: :class:`GatewayInterceptionError` (an ``InterceptionError``) for
the control plane, v1's ``TunnelError`` for the shared tunnel. A task whose hooks need
the env on every turn is the task's incompatibility with gateway mode:
:class:`GatewayFeatureError` (a ``TaskError``), raised before the harness starts.
"""

from __future__ import annotations

from verifiers.v1.errors import InterceptionError, TaskError, TunnelError

from rollout_gateway.errors import GatewayError, GatewayTunnelError


class GatewayInterceptionError(InterceptionError):
    """The rollout gateway's control plane failed (register, trajectory, cancel...).

    ``status_code`` is the gateway's HTTP status (``None`` when no answer came);
    ``retryable`` whether the failure was transient.
    """

    def __init__(
        self, message: str, *, status_code: int | None = None, retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retryable = retryable


class GatewayTunnelV1Error(TunnelError):
    """The shared tunnel to the gateway could not be opened or died."""


class GatewayFeatureError(TaskError):
    """The task needs an env-side hook on every turn, which a remote gateway cannot run.

    ``features`` names each one (``@intercept`` request rewrites, ``@stop`` on
    requests...). Raised before the harness starts; set the gateway interception's
    ``fallback = true`` to run such tasks through v1's own interception instead.
    """

    def __init__(self, features: list[str]) -> None:
        self.features = list(features)
        super().__init__(
            "gateway mode cannot run this task: it needs env-side hooks on every model "
            f"call ({'; '.join(self.features)}); set [env.interception] fallback = true to "
            "run such tasks through verifiers' own interception"
        )


def to_v1_error(error: Exception, what: str) -> Exception:
    """``error`` from the core as the v1 error a rollout records (``what`` names the step)."""
    if isinstance(error, GatewayTunnelError):
        return GatewayTunnelV1Error(f"{what}: {error}")
    if isinstance(error, GatewayError):
        return GatewayInterceptionError(
            f"{what}: {error}", status_code=error.status_code, retryable=error.retryable
        )
    return GatewayInterceptionError(f"{what}: {type(error).__name__}: {error}")


__all__ = [
    "GatewayFeatureError",
    "GatewayInterceptionError",
    "GatewayTunnelV1Error",
    "to_v1_error",
]
