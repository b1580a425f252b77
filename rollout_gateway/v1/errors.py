"""Gateway failures as verifiers v1 errors.

v1 attributes every rollout failure to the boundary it crossed (``verifiers.v1.errors``).
Gateway mode replaces v1's interception server, so a failing gateway is an
*interception* failure: v1's ``InterceptionError`` (:func:`interception_error`) for
the control plane, v1's ``TunnelError`` for the shared tunnel (v1's own classes, so the
trace's stop condition is v1's ``interception_error`` / ``tunnel_error``). A task whose hooks need
the env on every turn is the task's incompatibility with gateway mode:
:class:`GatewayFeatureError` (a ``TaskError``), raised before the harness starts.
"""

from __future__ import annotations

from verifiers.v1.errors import InterceptionError, TaskError, TunnelError

from rollout_gateway.errors import GatewayAuthError, GatewayError, GatewayTunnelError


def interception_error(
    message: str, *, status_code: int | None = None, retryable: bool = False
) -> InterceptionError:
    """v1's own ``InterceptionError`` (so the trace's stop is ``interception_error``, the
    name v1 and its consumers know), carrying the gateway's ``status_code`` (``None``
    when no answer came) and whether the failure was ``retryable``."""
    error = InterceptionError(message)
    error.status_code = status_code
    error.retryable = retryable
    return error


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
    """``error`` from the core as the v1 error a rollout records (``what`` names the step):
    v1's ``TunnelError`` for the tunnel, v1's ``InterceptionError`` for the rest."""
    if isinstance(error, GatewayTunnelError):
        return TunnelError(f"{what}: {error}")
    if isinstance(error, GatewayError):
        return interception_error(
            f"{what}: {error}", status_code=error.status_code, retryable=error.retryable
        )
    if isinstance(error, GatewayAuthError):  # configuration: retrying cannot help
        return interception_error(f"{what}: {error}", status_code=error.status_code)
    return interception_error(f"{what}: {type(error).__name__}: {error}")


__all__ = ["GatewayFeatureError", "interception_error", "to_v1_error"]
