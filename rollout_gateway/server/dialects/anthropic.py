"""The Anthropic Messages dialect (Claude Code, the ``anthropic`` SDKs).

Routes: ``{rollout}/v1/messages`` (the Anthropic SDK appends ``/v1/messages`` to its
base URL, so an agent's ``ANTHROPIC_BASE_URL`` is the rollout's URL without ``/v1``;
Claude Code adds ``?beta=true``, and any query string is ignored) and ``/v1/messages`` at
the gateway's root (the rollout found by its key). ``.../v1/messages/count_tokens`` is
answered and never recorded. The key comes as ``x-api-key`` (the SDK's and Claude
Code's carrier) or ``Authorization: Bearer`` (``ANTHROPIC_AUTH_TOKEN``). Headers such as
``anthropic-version`` and ``anthropic-beta`` are not read.

Parsing: :mod:`.anthropic_parse`; answers: :mod:`.anthropic_render`; streams:
:mod:`.anthropic_stream`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from rollout_gateway.server.dialects.anthropic_parse import (
    SAMPLING_FIELDS,
    MessagesContext,
    parse_messages_request,
)
from rollout_gateway.server.dialects.anthropic_render import (
    error_body,
    render_message,
    render_message_json,
    thinking_state,
)
from rollout_gateway.server.dialects.anthropic_stream import PING_EVENT, MessagesStream
from rollout_gateway.server.dialects.anthropic_wire import ErrorBody, Message, TokenCount
from rollout_gateway.server.dialects.base import Dialect, ParsedRequest
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.dialects.memo import ParseMemo
from rollout_gateway.server.dialects.reading import STATE_FIELD
from rollout_gateway.server.http.auth import parse_bearer
from rollout_gateway.server.http.jsonio import ConversationText

#: Bytes of request JSON per token in :func:`estimated_input_tokens` (English text and
#: JSON run at about 4 with common tokenizers).
BYTES_PER_TOKEN_ESTIMATE = 4


def _context(request: ParsedRequest) -> MessagesContext:
    context = request.context
    return context if isinstance(context, MessagesContext) else MessagesContext()


class AnthropicDialect(Dialect):
    """Anthropic Messages (see the module doc)."""

    name = "anthropic"
    routes = ("/v1/messages",)
    aux_routes = ("/v1/messages/count_tokens",)
    keyed_routes = ("/v1/messages",)
    keyed_aux_routes = ("/v1/messages/count_tokens",)
    upstream_path = "/v1/messages"
    sampling_fields: ClassVar[frozenset[str]] = SAMPLING_FIELDS
    keepalive = PING_EVENT

    def credential(self, authorization: str | None, api_key: str | None) -> str | None:
        """``x-api-key``, else an ``Authorization: Bearer`` token."""
        return api_key or parse_bearer(authorization)

    def parse(
        self, body: dict[str, Any], memo: Any = None, conversation: ConversationText | None = None
    ) -> ParsedRequest:
        memo = memo if isinstance(memo, ParseMemo) else None
        return parse_messages_request(body, memo=memo, text=conversation)

    def parse_count(self, body: dict[str, Any]) -> ParsedRequest:
        """A ``count_tokens`` body (no ``max_tokens``), parsed as a turn's would be."""
        return parse_messages_request(body, count_only=True)

    def render_count(self, input_tokens: int) -> TokenCount:
        """The ``count_tokens`` answer."""
        return {"input_tokens": input_tokens}

    def render(self, completion: dict[str, Any], request: ParsedRequest) -> Message:
        return render_message(completion, _context(request).show_thinking)

    def render_json(self, completion: dict[str, Any], request: ParsedRequest) -> bytes:
        return render_message_json(completion, _context(request).show_thinking)

    def stream(self, request: ParsedRequest) -> MessagesStream:
        return MessagesStream(_context(request))

    def error_body(self, error: GatewayError) -> ErrorBody:
        return error_body(error)

    def recorded_answer(self, message: dict[str, Any], request: ParsedRequest) -> dict[str, Any]:
        """The engine's message with the thinking block the agent got (and will echo)
        under ``reasoning_details``: v1 reads an Anthropic answer's thinking blocks as the
        message's provider state, so the recorded message must carry it too."""
        state = thinking_state(message, _context(request).show_thinking)
        return {**message, STATE_FIELD: state} if state else message


def estimated_input_tokens(request: ParsedRequest) -> int:
    """A ``count_tokens`` answer without a tokenizer: the request's messages and tools as
    JSON, :data:`BYTES_PER_TOKEN_ESTIMATE` bytes a token (an estimate: the engine's own
    count, when it can give one, is exact)."""
    tools = request.body.get("tools")
    size = len(request.messages_text) + (len(orjson.dumps(tools)) if tools else 0)
    return -(-size // BYTES_PER_TOKEN_ESTIMATE)


__all__ = ["BYTES_PER_TOKEN_ESTIMATE", "AnthropicDialect", "estimated_input_tokens"]
