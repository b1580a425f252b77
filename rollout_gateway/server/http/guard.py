"""The outermost ASGI layer of the gateway: reject odd paths, contain unexpected errors.

* A rollout id is one path segment of ``[A-Za-z0-9_-]``: a percent-encoded byte in it
  (``%2F`` decodes to ``/`` before routing) is refused with a 400 before routing.
* An unexpected exception becomes a short 500 (an error id, no repr) with
  ``Connection: close``, is logged with its traceback under that id, and is counted in
  ``rollout_gateway_internal_errors_total``. The agents' chat routes, which bypass this
  layer (:mod:`.dispatch`), answer their unexpected errors with the same functions.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from rollout_gateway.protocol import error_code
from rollout_gateway.server.http.jsonio import dumps

logger = logging.getLogger("rollout_gateway.server")

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

_ROLLOUTS_PREFIX = b"/v1/rollouts/"


async def _send_json(send: Send, status: int, body: dict[str, Any], close: bool) -> None:
    payload = dumps(body)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class GuardMiddleware:
    """See the module docstring. ``on_internal_error`` is called once per 500."""

    def __init__(self, app: Any, on_internal_error: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.on_internal_error = on_internal_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_path = scope.get("raw_path") or scope.get("path", "").encode()
        if raw_path.startswith(_ROLLOUTS_PREFIX) and b"%" in raw_path.split(b"?", 1)[0]:
            error = {
                "message": "invalid rollout id (expected one path segment of [A-Za-z0-9_-])",
                "type": "invalid_request_error",
                "code": "invalid_rollout_id",
            }
            await _send_json(send, 400, {"error": error}, close=False)
            return

        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            error_id = log_internal_error(scope, self.on_internal_error)
            if started:
                raise  # mid-answer: the server can only drop the connection
            await send_internal_error(send, error_id)


def log_internal_error(scope: Mapping[str, Any], on_internal_error: Callable[[], None]) -> str:
    """Count and log (with its traceback) the exception being handled; its error id."""
    error_id = secrets.token_hex(6)
    on_internal_error()
    logger.exception("internal error %s on %s", error_id, scope.get("path"))
    return error_id


async def send_internal_error(send: Send, error_id: str) -> None:
    """The short 500 answer (the error id, no repr), with ``Connection: close``."""
    body = {
        "message": f"internal gateway error (id {error_id})",
        "type": "internal_error",
        "code": error_code(500),
    }
    await _send_json(send, 500, {"error": body}, close=True)


__all__ = ["GuardMiddleware", "log_internal_error", "send_internal_error"]
