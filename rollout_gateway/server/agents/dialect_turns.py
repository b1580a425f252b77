"""The parts of a turn that depend on the agent's dialect, beside the chat path's own.

A turn asked in Anthropic Messages or OpenAI Responses runs as a chat turn
(:mod:`.chat`); what differs is here: its fingerprint (keyed with the dialect), the
stream renderer it carries (:class:`DialectTurn`), its answer rendered for the request
that asks (:func:`dialect_answer`, a retry's replay too), and refusals as every dialect
renders them (:func:`as_gateway_error`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from rollout_gateway.server.dialects.base import Dialect, ParsedRequest, StreamRenderer
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.dialects.routes import dialect_named
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.responses import ApiError
from rollout_gateway.server.state.dedupe import Turn

#: The chat completions dialect: the gateway's own path, its bytes as they always were.
CHAT: Dialect = dialect_named("chat")


@dataclass(eq=False)
class DialectTurn(Turn):
    """A turn asked in another dialect than chat: the renderer of its stream (each
    engine chunk becomes the dialect's events as it comes) and the events that close
    it, written once the answer is in (every waiter relays the same ones)."""

    renderer: StreamRenderer | None = None
    closing: bytes = b""


def dialect_fingerprint(dialect: Dialect, fingerprint: bytes) -> bytes:
    """The fingerprint of a body sent in ``dialect`` (a body can be valid in two
    dialects: a chat request must not join a Messages turn). Chat's is the body's own."""
    if dialect is CHAT:
        return fingerprint
    digest = hashlib.blake2b(fingerprint, digest_size=len(fingerprint) or 16)
    digest.update(dialect.name.encode())
    return digest.digest()


def as_gateway_error(exc: ApiError) -> GatewayError:
    """A refusal of the turn as every dialect renders it."""
    return GatewayError(exc.status_code, exc.message, exc.code, exc.error_type, None, exc.headers)


def dialect_answer(
    dialect: Dialect, parsed: ParsedRequest, answer: dict[str, Any] | bytes
) -> Response:
    """The turn's answer (the engine's completion, the agent's view) in ``dialect``:
    rendered for the request that asked (a retry's replay too), whole or as its stream."""
    completion: dict[str, Any] = (
        jsonio.loads_lenient(answer) if isinstance(answer, bytes) else answer
    )
    if parsed.stream:
        events = dialect.stream(parsed).whole(completion)
        return Response(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        return Response(dialect.render_json(completion, parsed), media_type="application/json")
    except TypeError:  # orjson's JSONEncodeError: an answer nested deeper than it writes
        raise ApiError(502, "upstream answer is malformed", "upstream_error") from None


__all__ = ["CHAT", "DialectTurn", "as_gateway_error", "dialect_answer", "dialect_fingerprint"]
