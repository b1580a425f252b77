"""The Chat Completions dialect: the gateway's own behaviour, expressed as a dialect.

Nothing is translated: the agent's body is the chat request (its unread fields' values
dropped, :func:`~..engines.upstream_request.drop_unread_values`), the answer is the
engine's completion trimmed to what the agent asked for, the stream is the engine's own
chunks trimmed the same way and ended by ``data: [DONE]``, and errors are
``{"error": {"message", "type", "code"}}``. Each part delegates to the module that has
always done it (``agents/sse.py``, ``engines/streaming.py``, ``engines/turn.py``,
``engines/upstream_request.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from rollout_gateway.protocol import BEARER_CHAT_COMPLETIONS_PATH, error_code
from rollout_gateway.server.agents.sse import (
    DONE_EVENT,
    error_event,
    guard_sse,
    iter_completion_sse,
)
from rollout_gateway.server.dialects.base import Dialect, ParsedRequest, StreamRenderer
from rollout_gateway.server.dialects.errors import GatewayError, RequestError
from rollout_gateway.server.engines.streaming import KEEPALIVE_EVENT, agent_chunk, sse_event
from rollout_gateway.server.engines.turn import agent_answer, wants_usage
from rollout_gateway.server.engines.upstream_request import (
    drop_unread_values,
    dropped_field_facts,
)
from rollout_gateway.server.http.jsonio import ConversationText
from rollout_gateway.server.http.responses import (
    ApiError,
    validate_answer_flags,
    validate_messages,
)


class ChatStream(StreamRenderer):
    """The engine's chunks as the agent asked for them (ids, logprobs, usage, reasoning
    only when asked), then ``[DONE]``."""

    keepalive = KEEPALIVE_EVENT

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.include_usage = wants_usage(body)

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out = agent_chunk(chunk, self.body, include_usage=self.include_usage)
        return sse_event(out) if out is not None else b""

    def finish(self, completion: dict[str, Any]) -> bytes:
        return DONE_EVENT

    def error(self, error: GatewayError) -> bytes:
        return error_event(error.message, error.code or "upstream_error") + DONE_EVENT

    def whole(self, completion: dict[str, Any]) -> bytes:
        answer = agent_answer(completion, self.body)
        events = iter_completion_sse(answer, include_usage=self.include_usage)
        return b"".join(guard_sse(events))


class ChatDialect(Dialect):
    """OpenAI Chat Completions (``{rollout}/chat/completions``, ``/v1/chat/completions``)."""

    name = "chat"
    routes = ("/chat/completions",)
    keyed_routes = (BEARER_CHAT_COMPLETIONS_PATH,)
    upstream_path = "/chat/completions"
    sampling_fields: ClassVar[frozenset[str]] = frozenset(
        {
            "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens",
            "reasoning_effort", "seed", "stop", "n", "logprobs", "top_logprobs", "logit_bias",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "response_format",
            "service_tier", "tool_choice", "parallel_tool_calls", "extra_body",
        }
    )  # fmt: skip
    keepalive = KEEPALIVE_EVENT

    def parse(
        self, body: dict[str, Any], memo: Any = None, conversation: ConversationText | None = None
    ) -> ParsedRequest:
        """The agent's body as it is (``memo`` and ``conversation`` unused: nothing is
        translated)."""
        drop_unread_values(body)
        try:
            messages = validate_messages(body)
            validate_answer_flags(body)
        except ApiError as exc:
            raise RequestError(exc.message, code=exc.code) from None
        return ParsedRequest(
            dialect=self.name,
            body=body,
            messages=messages,
            messages_text=orjson.dumps(messages),
            stream=bool(body.get("stream")),
            facts={"dialect": self.name, **dropped_field_facts(body)},
        )

    def render(self, completion: dict[str, Any], request: ParsedRequest) -> dict[str, Any]:
        return agent_answer(completion, request.body)

    def stream(self, request: ParsedRequest) -> ChatStream:
        return ChatStream(request.body)

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        return {
            "error": {
                "message": error.message,
                "type": error.error_type or "invalid_request_error",
                "code": error.code or error_code(error.status),
            }
        }


__all__ = ["ChatDialect", "ChatStream"]
