"""OpenAI-style JSON error answers shared by the gateway and the scripted model.

Errors are ``{"error": {"message", "type", "code"}}`` so that the OpenAI SDK (and our
control-plane client) surface the message instead of a bare status code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from rollout_gateway.server.jsonio import (
    BodyParser,
    JSONBytesResponse,
    JSONDecodeError,
    loads_off_loop,
)


class ApiError(Exception):
    """An error answer: raise it in a handler, :func:`error_response` renders it."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str,
        *,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.code = code
        self.headers = dict(headers or {})


def error_response(
    status_code: int,
    message: str,
    error_type: str,
    *,
    code: str | int | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONBytesResponse:
    """JSON error answer in the OpenAI shape (``code`` defaults to the status)."""
    error = {"message": message, "type": error_type, "code": status_code if code is None else code}
    return JSONBytesResponse({"error": error}, status_code=status_code, headers=headers)


async def api_error_handler(request: Request, exc: Exception) -> JSONBytesResponse:
    """Starlette exception handler for :class:`ApiError`."""
    assert isinstance(exc, ApiError)
    return error_response(
        exc.status_code, exc.message, exc.error_type, code=exc.code, headers=exc.headers
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) beyond ``max_bytes`` without buffering it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:  # chunked bodies: no content-length, count
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
        body += chunk
    return bytes(body)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body parsed as a JSON object (400 when it is not one).

    Strict JSON (see :mod:`rollout_gateway.server.jsonio`): lone surrogates, ``NaN``,
    ``1e400`` and nesting deeper than 1024 levels are 400s; big bodies parse off the loop.
    """
    raw = await read_body(request, max_bytes)
    return await parse_json_object(raw)


async def parse_json_object(raw: bytes, parser: BodyParser | None = None) -> dict[str, Any]:
    """``raw`` parsed as a JSON object (400 when it is not one), by ``parser`` when given
    (the gateway's, which bounds concurrent big parses)."""
    if not raw.strip():
        raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
    try:
        body = await (parser.loads(raw) if parser is not None else loads_off_loop(raw))
    except JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
    return body


def validate_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``body["messages"]``, checked to be a non-empty list of message objects (else 400)."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", "invalid_request_error")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "invalid_request_error")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(
                400, "each message must be an object with a 'role'", "invalid_request_error"
            )
    return messages


__all__ = [
    "ApiError",
    "api_error_handler",
    "error_response",
    "parse_json_object",
    "read_body",
    "read_json_object",
    "validate_messages",
]
