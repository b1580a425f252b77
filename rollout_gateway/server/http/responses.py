"""OpenAI-style JSON error answers shared by the gateway and the scripted model.

Errors are ``{"error": {"message", "type", "code"}}`` so that the OpenAI SDK (and our
control-plane client) surface the message instead of a bare status code; ``code`` is
always a string (:func:`rollout_gateway.protocol.error_code` when no specific one is
given), as in OpenAI's API. Request
bodies are read here too, bounded in size, for every route (:func:`receive_body`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.types import Receive

from rollout_gateway.protocol import error_code, is_valid_rollout_id
from rollout_gateway.server.http.jsonio import (
    JSONBytesResponse,
    JSONDecodeError,
    TooDeepError,
    loads_off_loop,
)

#: Bodies of the control plane's routes and of the agents' exit report are small.
CONTROL_BODY_LIMIT = 1024 * 1024


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


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
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONBytesResponse:
    """JSON error answer in the OpenAI shape (``code`` defaults to the status's name)."""
    error = {"message": message, "type": error_type, "code": code or error_code(status_code)}
    return JSONBytesResponse({"error": error}, status_code=status_code, headers=headers)


async def api_error_handler(request: Request, exc: Exception) -> JSONBytesResponse:
    """Starlette exception handler for :class:`ApiError`."""
    assert isinstance(exc, ApiError)
    return error_response(
        exc.status_code, exc.message, exc.error_type, code=exc.code, headers=exc.headers
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) beyond ``max_bytes`` without buffering it all."""
    return await receive_body(request.receive, request.headers.get("content-length"), max_bytes)


async def receive_body(receive: Receive, content_length: str | None, max_bytes: int) -> bytes:
    """The body of an ASGI request, read from ``receive``: 413 beyond ``max_bytes`` (by the
    declared ``content_length`` at once, else by counting), :class:`ClientGone` if the
    client disconnects first. A body that arrives in one piece is not copied."""
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:  # chunked bodies: no content-length, count
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if len(chunks) == 1:
        return bytes(chunks[0])  # bytes already (a no-op) unless a server passed a buffer
    return b"".join(chunks)


async def until_disconnect(receive: Receive) -> None:
    """Return when the client closes its connection (call once the body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body parsed as a JSON object (400 when it is not one).

    Strict JSON (see :mod:`rollout_gateway.server.http.jsonio`): lone surrogates, ``NaN``,
    ``1e400`` and nesting deeper than 128 levels are 400s; big bodies parse off the loop.
    """
    raw = await read_body(request, max_bytes)
    return await parse_json_object(raw)


async def parse_json_object(
    raw: bytes, parse: Callable[[bytes], Awaitable[Any]] | None = None
) -> dict[str, Any]:
    """``raw`` parsed as a JSON object (400 when it is not one), by ``parse`` when given
    (the chat routes': :meth:`~.intake.BodyIntake.parse`, which bounds what bodies cost)."""
    if not raw.strip():
        raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
    try:
        body = await (parse(raw) if parse is not None else loads_off_loop(raw))
    except TooDeepError as exc:
        raise ApiError(400, str(exc), "invalid_request_error") from None
    except JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
    return body


def checked_rollout_id(rollout_id: str) -> str:
    """``rollout_id`` from a request path, if it is a valid id (else 400)."""
    if not is_valid_rollout_id(rollout_id):
        raise ApiError(
            400,
            "invalid rollout id (expected [A-Za-z0-9_-]{1,128})",
            "invalid_request_error",
            code="invalid_rollout_id",
        )
    return rollout_id


def validate_messages(
    body: dict[str, Any], max_messages: int | None = None
) -> list[dict[str, Any]]:
    """``body["messages"]``, checked to be a non-empty list of message objects, at most
    ``max_messages`` of them (else 400)."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", "invalid_request_error")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "invalid_request_error")
    if max_messages is not None and len(messages) > max_messages:
        raise ApiError(
            400,
            f"too many messages: {len(messages)} (this gateway takes at most {max_messages})",
            "invalid_request_error",
            code="too_many_messages",
        )
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(
                400, "each message must be an object with a 'role'", "invalid_request_error"
            )
    return messages


#: Boolean fields of a chat request that shape the gateway's answer (streamed or not,
#: token fields, reasoning). Python reads the string ``"false"`` as true (and the engine,
#: pydantic, as false): anything but a boolean or null is refused, not guessed.
ANSWER_FLAGS = ("stream", "logprobs", "return_token_ids", "include_reasoning")


def validate_answer_flags(body: Mapping[str, Any]) -> None:
    """Refuse (400) :data:`ANSWER_FLAGS` and ``stream_options.include_usage`` that are
    not booleans (or null), and ``stream_options`` that is not an object (or null)."""
    for key in ANSWER_FLAGS:
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"'{key}' must be a boolean", "invalid_request_error")
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "invalid_request_error")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError(
            400, "'stream_options.include_usage' must be a boolean", "invalid_request_error"
        )


__all__ = [
    "ANSWER_FLAGS",
    "CONTROL_BODY_LIMIT",
    "ApiError",
    "ClientGone",
    "api_error_handler",
    "checked_rollout_id",
    "error_response",
    "parse_json_object",
    "read_body",
    "read_json_object",
    "receive_body",
    "until_disconnect",
    "validate_answer_flags",
    "validate_messages",
]
