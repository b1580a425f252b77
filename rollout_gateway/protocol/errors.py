"""How the protocol says no: error codes of error answers, and the error of a bad body.

Every error answer is ``{"error": {"message", "type", "code"}}`` and its ``code`` is
always a string, as in OpenAI's API (never the HTTP status number): a specific one where
the gateway has it (``rollout_not_found``, ``max_turns_reached``,
``context_length_exceeded``...), else the status's name (:data:`STATUS_ERROR_CODES`).
"""

from __future__ import annotations

from typing import Literal


class BodyError(ValueError):
    """A body that is not the protocol's shape (the message names the field). The server
    answers it 400; a client raises it as a protocol error of the gateway."""


#: Status of a refused chat turn (rollout cancelled, completed, or at one of its limits).
#: Not 409 as in the original table: the OpenAI SDK (and litellm) retry 408, 409, 429 and
#: 5xx, so an agent would re-send a refused turn for minutes. The error's ``code`` says
#: why (one of :data:`TURN_REFUSAL_CODES`); refusals also carry ``x-should-retry: false``.
TURN_REFUSED_STATUS = 403

#: ``error.code`` values of a refused turn.
TurnRefusalCode = Literal[
    "rollout_cancelled",
    "rollout_completed",
    "max_turns_reached",
    "max_completion_tokens_reached",
    "max_context_reached",
    "max_rollout_bytes_reached",
    "max_input_tokens_reached",
    "max_output_tokens_reached",
    "max_total_tokens_reached",
]
TURN_REFUSAL_CODES: tuple[str, ...] = TurnRefusalCode.__args__  # type: ignore[attr-defined]

#: ``error.code`` of an error answer that names no more specific code: the status's name.
STATUS_ERROR_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "unprocessable_entity",
    429: "too_many_requests",
    431: "request_headers_too_large",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


def error_code(status: int) -> str:
    """The ``error.code`` of an error answer with ``status`` and no more specific code."""
    return STATUS_ERROR_CODES.get(status, f"http_{status}")


__all__ = [
    "STATUS_ERROR_CODES",
    "TURN_REFUSAL_CODES",
    "TURN_REFUSED_STATUS",
    "BodyError",
    "TurnRefusalCode",
    "error_code",
]
