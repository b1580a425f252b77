"""An Anthropic Messages stream, produced chunk by chunk from the engine's chat chunks.

The event sequence the ``anthropic`` SDKs' ``messages.stream()`` helpers assemble (and
Claude Code reads): ``message_start`` (at the engine's first chunk: the answer's id,
model and prompt size), then per block ``content_block_start``, its deltas
(``thinking_delta``, ``text_delta``, ``input_json_delta``) as the engine's chunks bring
them, ``content_block_stop`` when the next kind of output begins, and at the end
``message_delta`` (stop reason, usage) and ``message_stop``. Every event carries its
``event:`` line (the Python SDK skips events without one). Keepalive: ``ping`` events,
which the SDKs skip anywhere in a stream.

The per-chunk work is a few dictionary lookups and one ``orjson.dumps`` of the new text:
delta events are written from byte templates, not built as dictionaries.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_gateway.server.dialects.anthropic_parse import MessagesContext
from rollout_gateway.server.dialects.anthropic_render import (
    error_body,
    message_id,
    stop_of,
    usage_of,
)
from rollout_gateway.server.dialects.base import StreamRenderer, named_event
from rollout_gateway.server.dialects.completion import delta_reasoning, first_choice
from rollout_gateway.server.dialects.errors import GatewayError

#: Anthropic's keepalive event.
PING_EVENT = b'event: ping\ndata: {"type": "ping"}\n\n'

_DELTA_HEAD = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_TEXT = b',"delta":{"type":"text_delta","text":'
_THINKING = b',"delta":{"type":"thinking_delta","thinking":'
_JSON = b',"delta":{"type":"input_json_delta","partial_json":'
_DELTA_TAIL = b"}}\n\n"


class MessagesStream(StreamRenderer):
    """The stream of one answer (see the module doc)."""

    keepalive = PING_EVENT

    def __init__(self, context: MessagesContext) -> None:
        self.show_thinking = context.show_thinking
        self.started = False
        #: The open content block: its index (-1: none) and what it holds ("thinking",
        #: "text", or a tool call's index in the engine's answer).
        self.index = -1
        self.holds: str | int | None = None

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out = b"" if self.started else self._start(chunk)
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict) or not delta:
                continue
            reasoning = delta_reasoning(delta)
            if reasoning and self.show_thinking:
                out += self._open("thinking", _THINKING_BLOCK)
                out += _delta(self.index, _THINKING, reasoning)
            content = delta.get("content")
            if isinstance(content, str) and content:
                out += self._open("text", _TEXT_BLOCK)
                out += _delta(self.index, _TEXT, content)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._tool_delta(call)
        return out

    def finish(self, completion: dict[str, Any]) -> bytes:
        out = b"" if self.started else self._start(completion)
        out += self._close()
        choice = first_choice(completion)
        message = choice.get("message")
        calls = isinstance(message, dict) and bool(message.get("tool_calls"))
        stop_reason, stop_sequence = stop_of(choice, calls)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        out += named_event(
            b"message_delta",
            {"type": "message_delta", "delta": delta, "usage": usage_of(completion.get("usage"))},
        )
        return out + named_event(b"message_stop", {"type": "message_stop"})

    def error(self, error: GatewayError) -> bytes:
        return named_event(b"error", error_body(error))

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        prompt_ids = chunk.get("prompt_token_ids")
        message: dict[str, Any] = {
            "id": message_id(chunk.get("id")),
            "type": "message",
            "role": "assistant",
            "model": str(chunk.get("model") or ""),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # The prompt's size when the engine sends its ids first (vLLM); message_delta
            # carries the final counts.
            "usage": {
                "input_tokens": len(prompt_ids) if isinstance(prompt_ids, list) else 0,
                "output_tokens": 0,
            },
        }
        return named_event(b"message_start", {"type": "message_start", "message": message})

    def _open(self, holds: str | int, block: dict[str, Any]) -> bytes:
        """Open a block holding ``holds`` unless it is the open one (closing that)."""
        if self.holds == holds:
            return b""
        out = self._close()
        self.index += 1
        self.holds = holds
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + named_event(b"content_block_start", start)

    def _close(self) -> bytes:
        if self.holds is None:
            return b""
        self.holds = None
        stop = {"type": "content_block_stop", "index": self.index}
        return named_event(b"content_block_stop", stop)

    def _tool_delta(self, call: dict[str, Any]) -> bytes:
        position = call.get("index")
        position = position if isinstance(position, int) else 0
        kind = "custom" if call.get("type") == "custom" or "custom" in call else "function"
        native = call.get(kind)
        native = native if isinstance(native, dict) else {}
        out = b""
        if self.holds != position:
            name = native.get("name")
            block = {
                "type": "tool_use",
                "id": str(call.get("id") or ""),
                "name": name if isinstance(name, str) else "",
                "input": {},
            }
            out = self._open(position, block)
        arguments = native.get("input" if kind == "custom" else "arguments")
        if isinstance(arguments, str) and arguments:
            out += _delta(self.index, _JSON, arguments)
        return out


_THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}
_TEXT_BLOCK = {"type": "text", "text": ""}


def _delta(index: int, kind: bytes, text: str) -> bytes:
    return _DELTA_HEAD + str(index).encode() + kind + orjson.dumps(text) + _DELTA_TAIL


__all__ = ["PING_EVENT", "MessagesStream"]
