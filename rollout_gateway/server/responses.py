"""OpenAI-style JSON error answers shared by the gateway and the scripted model.

Errors are ``{"error": {"message", "type", "code"}}`` so that the OpenAI SDK (and our
control-plane client) surface the message instead of a bare status code.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answer: raise it in a handler, :func:`error_response` renders it."""

    def __init__(self, status_code: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type


def error_response(status_code: int, message: str, error_type: str) -> JSONResponse:
    """JSON error answer in the OpenAI shape."""
    body = {"error": {"message": message, "type": error_type, "code": status_code}}
    return JSONResponse(body, status_code=status_code)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette exception handler for :class:`ApiError`."""
    assert isinstance(exc, ApiError)
    return error_response(exc.status_code, exc.message, exc.error_type)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) beyond ``max_bytes`` without buffering it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:  # chunked bodies have no content-length: count as we go
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body parsed as a JSON object (400 when it is not one)."""
    raw = await read_body(request, max_bytes)
    if not raw.strip():
        raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
    try:
        body = json.loads(raw)
    except ValueError as exc:
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
    "read_body",
    "read_json_object",
    "validate_messages",
]
