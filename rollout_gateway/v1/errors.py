"""Gateway failures as verifiers v1 errors: v1's own classes, so v1's own names.

v1 attributes every rollout failure to the boundary it crossed (``verifiers.v1.errors``)
and derives the trace's stop condition and the recorded error type from the class name
(``ProviderError`` -> ``provider_error``); prime-rl's dashboards and v1's retry rules
match on those. So every error the adapter leaves on a trace is an instance of v1's own
class, with the gateway's detail in its message and attributes:

- :func:`interception_error`: v1's ``InterceptionError``, the gateway's control plane
  failed (it replaces v1's interception server); v1's ``TunnelError`` for the tunnel;
- :func:`provider_error`: v1's ``ProviderError`` for an engine call that failed behind
  the gateway, with the status v1's own client would have given it
  (:func:`provider_status`);
- :func:`feature_error`: v1's ``TaskError`` for a task whose hooks need the env on every
  model call (the task cannot run in gateway mode; stop ``task_error``).
  :class:`GatewayFeatureError` is that error's class at ``serving()`` time, before any
  rollout (an env whose toolsets need the env), where no trace records it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_gateway.errors import GatewayAuthError, GatewayError, GatewayTunnelError
from rollout_gateway.v1.internals import (
    InterceptionError,
    ProviderError,
    TaskError,
    TunnelError,
)


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


#: The status v1's own eval client gives a failed engine call, by the gateway's failure
#: kind (``verifiers.v1.clients.eval``: a timeout is 504, any other transport fault 503, a
#: malformed answer 502, an HTTP error the provider's own status).
_KIND_STATUS = {"connect": 503, "transport": 503, "timeout": 504, "protocol": 502}


def provider_status(error: Mapping[str, Any]) -> int:
    """The HTTP status v1's own interception records for a failed engine call the
    gateway recorded as ``error`` (a ``failed_turns`` entry's ``error``)."""
    upstream = error.get("upstream_status")
    if isinstance(upstream, int) and not isinstance(upstream, bool):
        return upstream  # the engine's own status, as v1 relays it
    status = _KIND_STATUS.get(str(error.get("type")))
    if status is not None:
        return status
    code = error.get("status_code")
    return code if isinstance(code, int) and not isinstance(code, bool) else 502


def provider_error(error: Mapping[str, Any]) -> ProviderError:
    """v1's ``ProviderError`` for an engine call the gateway recorded as failed."""
    return ProviderError(
        str(error.get("message") or "engine call failed"), status_code=provider_status(error)
    )


def feature_message(features: list[str]) -> str:
    """Why gateway mode refuses a task that needs ``features`` on every model call."""
    return (
        "gateway mode cannot run this task: it needs env-side hooks on every model "
        f"call ({'; '.join(features)}); set [env.interception] fallback = true to "
        "run such tasks through verifiers' own interception"
    )


def feature_error(features: list[str]) -> TaskError:
    """v1's own ``TaskError`` for a rollout whose task needs ``features`` (its
    ``features`` attribute names them): the trace records ``TaskError`` and stops
    ``task_error``, names v1 and prime-rl know."""
    error = TaskError(feature_message(features))
    error.features = list(features)
    return error


class GatewayFeatureError(TaskError):
    """An env's tasks need an env-side hook on every turn (tool servers on the
    ``/state`` channel), which a remote gateway cannot run: raised by ``serving()``
    before any rollout. ``features`` names each one."""

    def __init__(self, features: list[str]) -> None:
        self.features = list(features)
        super().__init__(feature_message(self.features))


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


__all__ = [
    "GatewayFeatureError",
    "feature_error",
    "interception_error",
    "provider_error",
    "provider_status",
    "to_v1_error",
]
