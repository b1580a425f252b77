"""An OpenAI Responses stream, produced chunk by chunk from the engine's chat chunks.

The event sequence the ``openai`` SDK's ``responses.stream()`` helper assembles (and
Codex reads): ``response.created`` and ``response.in_progress`` at the engine's first
chunk; per output item ``response.output_item.added``, its deltas as the engine's chunks
bring them (``response.reasoning_text.delta``; ``response.content_part.added`` then
``response.output_text.delta``; ``response.function_call_arguments.delta``;
``response.custom_tool_call_input.delta``), its ``*.done`` events and
``response.output_item.done`` when the next kind of output begins; at the end
``response.completed`` (``response.incomplete`` when the engine cut the answer) with the
whole answer, the very object a non-streamed request gets. Events are numbered
(``sequence_number``) and carry their ``event:`` line.

Errors after the stream started: ``response.failed`` (what Codex acts on) with a
top-level ``error`` too (what the OpenAI SDK raises on). Keepalive: an SSE comment
(Codex's own idle timeout, ``stream_idle_timeout_ms``, is 300 s by default).
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_gateway.server.dialects.base import StreamRenderer
from rollout_gateway.server.dialects.completion import delta_reasoning, id_base
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.dialects.responses_parse import ResponsesContext
from rollout_gateway.server.dialects.responses_render import (
    error_body,
    message_item,
    reasoning_item,
    render_response,
    response_head,
    usual_answer,
    usual_response_json,
)
from rollout_gateway.server.dialects.responses_wire import Response

_DELTA_EVENTS = {
    "reasoning": b"response.reasoning_text.delta",
    "message": b"response.output_text.delta",
    "function": b"response.function_call_arguments.delta",
    "custom": b"response.custom_tool_call_input.delta",
}


#: An event: its kind twice, its sequence number, its other fields' JSON text.
_FRAME = b'event: %b\ndata: {"type":"%b","sequence_number":%d%b}\n\n'


#: A delta event up to its sequence number: its kind twice, the item's id (JSON), the
#: item's position, its content index field (or nothing).
_DELTA_PREFIX = b'event: %b\ndata: {"type":"%b","item_id":%b,"output_index":%d%b,"sequence_number":'


#: A delta event: its prefix, sequence number, text (JSON) and suffix.
_DELTA = b'%b%d,"delta":%b%b'

#: A message item's opening events (what :meth:`ResponsesStream._event` writes of them):
#: ``output_item.added`` (its sequence number, position, the item's id as JSON) and
#: ``content_part.added`` (its sequence number, the item's id, position).
_OPEN_MESSAGE = (
    b"event: response.output_item.added\n"
    b'data: {"type":"response.output_item.added","sequence_number":%d,"output_index":%d,'
    b'"item":{"id":%b,"type":"message","status":"in_progress","role":"assistant",'
    b'"content":[]}}\n\n'
    b"event: response.content_part.added\n"
    b'data: {"type":"response.content_part.added","sequence_number":%d,"item_id":%b,'
    b'"output_index":%d,"content_index":0,'
    b'"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]}}\n\n'
)

#: A message item's closing events: ``output_text.done``, ``content_part.done``,
#: ``output_item.done``, each with its sequence number, the item's id (JSON), position,
#: text (JSON).
_CLOSE_MESSAGE = (
    b"event: response.output_text.done\n"
    b'data: {"type":"response.output_text.done","sequence_number":%d,"item_id":%b,'
    b'"output_index":%d,"content_index":0,"text":%b,"logprobs":[]}\n\n'
    b"event: response.content_part.done\n"
    b'data: {"type":"response.content_part.done","sequence_number":%d,"item_id":%b,'
    b'"output_index":%d,"content_index":0,'
    b'"part":{"type":"output_text","text":%b,"annotations":[],"logprobs":[]}}\n\n'
    b"event: response.output_item.done\n"
    b'data: {"type":"response.output_item.done","sequence_number":%d,"output_index":%d,'
    b'"item":{"id":%b,"type":"message","status":"completed","role":"assistant",'
    b'"content":[{"type":"output_text","text":%b,"annotations":[],"logprobs":[]}]}}\n\n'
)


class _OpenItem:
    """The output item being streamed: its kind, position, id and text so far."""

    __slots__ = ("kind", "key", "index", "id", "id_json", "parts", "item", "prefix", "suffix")

    def __init__(self, kind: str, key: Any, index: int, item: dict[str, Any]) -> None:
        self.kind = kind
        self.key = key
        self.index = index
        self.id: str = item["id"]
        self.item = item
        self.parts: list[str] = []
        self.id_json = orjson.dumps(self.id)
        name = _DELTA_EVENTS[kind]
        content = b',"content_index":0' if kind in ("reasoning", "message") else b""
        # The delta event of this item, around its sequence number and its text.
        self.prefix = _DELTA_PREFIX % (name, name, self.id_json, index, content)
        self.suffix = b',"logprobs":[]}\n\n' if kind == "message" else b"}\n\n"


class ResponsesStream(StreamRenderer):
    """The stream of one answer (see the module doc)."""

    def __init__(self, context: ResponsesContext) -> None:
        self.context = context
        self.sequence = 0
        self.base: str | None = None
        self.head: Response | None = None
        self.open: _OpenItem | None = None
        self.items = 0
        self.first_id: Any = None  # the engine's completion id, as its first chunk said

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out = b"" if self.head is not None else self._start(chunk)
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict) or not delta:
                continue
            if "reasoning" in delta or "reasoning_content" in delta:  # (else no call)
                reasoning = delta_reasoning(delta)
                if reasoning:
                    out += self._delta("reasoning", "reasoning", reasoning)
            content = delta.get("content")
            if isinstance(content, str) and content:
                out += self._delta("message", "message", content)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._call_delta(call)
        return out

    def finish(self, completion: dict[str, Any]) -> bytes:
        out = b"" if self.head is not None else self._start(completion)
        out += self._close()
        # The ids' base as the first chunk's made it, for the same completion id.
        base = self.base if completion.get("id") == self.first_id else None
        usual = usual_answer(completion) if self.items else None
        if usual is not None:  # its one item streamed: the answer from its template
            answer = usual_response_json(
                completion, self.context, usual, base or id_base(completion.get("id"))
            )
            return out + self._framed(b"response.completed", b',"response":' + answer)
        final = render_response(completion, self.context, base)
        for index, item in enumerate(final["output"][self.items :], start=self.items):
            out += self._event("response.output_item.added", output_index=index, item=item)
            out += self._event("response.output_item.done", output_index=index, item=item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=final)

    def error(self, error: GatewayError) -> bytes:
        body = error_body(error)
        failed = dict(self.head or response_head("failed", 0, "", self.context))
        failed.update(
            status="failed",
            error={"code": body["error"]["code"], "message": error.message},
        )
        return self._event("response.failed", response=failed, error=body["error"])

    def _event(self, kind: str, **payload: Any) -> bytes:
        # The payload's fields written by orjson after the event's own two (the bytes of
        # ``{"type", "sequence_number", **payload}`` written whole, without that dict).
        return self._framed(kind.encode(), b"," + orjson.dumps(payload)[1:-1])

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.first_id = chunk.get("id")
        self.base = id_base(self.first_id)
        self.head = response_head(self.base, chunk.get("created"), chunk.get("model"), self.context)
        # Both events carry the same head: written once (orjson writes the same bytes
        # inside either event's object).
        head = orjson.dumps(self.head)
        out = self._framed(b"response.created", b',"response":' + head)
        return out + self._framed(b"response.in_progress", b',"response":' + head)

    def _framed(self, kind: bytes, fields: bytes) -> bytes:
        """The event ``kind`` whose fields after its ``type`` and ``sequence_number``
        are the JSON text ``fields`` (``,"name":value...``), numbered."""
        sequence = self.sequence
        self.sequence += 1
        return _FRAME % (kind, kind, sequence, fields)  # one C call

    def _delta(self, kind: str, key: Any, text: str) -> bytes:
        out = b""
        current = self.open
        if current is None or current.key != key:
            out = self._open(kind, key, self._new_item(kind))
            current = self.open
            assert current is not None
        current.parts.append(text)
        sequence = self.sequence
        self.sequence += 1
        delta = _DELTA % (current.prefix, sequence, orjson.dumps(text), current.suffix)
        return out + delta if out else delta

    def _new_item(self, kind: str) -> dict[str, Any]:
        base = self.base or "gateway"
        if kind == "reasoning":
            item: dict[str, Any] = dict(reasoning_item(base, ""))
            item["content"] = []
            return item
        item = dict(message_item(base, ""))
        item.update(status="in_progress", content=[])
        return item

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        position = call.get("index")
        position = position if isinstance(position, int) else 0
        custom = call.get("type") == "custom" or "custom" in call
        kind = "custom" if custom else "function"
        native = call.get(kind)
        native = native if isinstance(native, dict) else {}
        text = native.get("input" if custom else "arguments")
        key = ("call", position)
        out = b""
        if self.open is None or self.open.key != key:
            out = self._open(kind, key, self._call_item(kind, position, call, native))
        if isinstance(text, str) and text:
            out += self._delta(kind, key, text)
        return out

    def _call_item(
        self, kind: str, position: int, call: dict[str, Any], native: dict[str, Any]
    ) -> dict[str, Any]:
        base = self.base or "gateway"
        name = native.get("name") if isinstance(native.get("name"), str) else ""
        call_id = str(call.get("id") or "")
        if kind == "custom":
            item_id = f"ctc_{base}_{position}"
            return {
                "id": item_id,
                "type": "custom_tool_call",
                "call_id": call_id,
                "name": name,
                "input": "",
            }
        item: dict[str, Any] = {
            "id": f"fc_{base}_{position}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        namespace = self.context.namespaces.get(str(name))
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def _open(self, kind: str, key: Any, item: dict[str, Any]) -> bytes:
        out = self._close()
        index = self.items
        self.items += 1
        self.open = opened = _OpenItem(kind, key, index, item)
        if kind == "message":  # its two events from their template (no dicts written)
            sequence = self.sequence
            self.sequence += 2
            return out + _OPEN_MESSAGE % (
                sequence,
                index,
                opened.id_json,
                sequence + 1,
                opened.id_json,
                index,
            )
        return out + self._event("response.output_item.added", output_index=index, item=item)

    def _close(self) -> bytes:
        current = self.open
        if current is None:
            return b""
        self.open = None
        text = "".join(current.parts)
        if current.kind == "message":  # its three events from their template
            sequence = self.sequence
            self.sequence += 3
            item_id, index, text_json = current.id_json, current.index, orjson.dumps(text)
            return _CLOSE_MESSAGE % (
                sequence, item_id, index, text_json,
                sequence + 1, item_id, index, text_json,
                sequence + 2, index, item_id, text_json,
            )  # fmt: skip
        where = {"item_id": current.id, "output_index": current.index}
        base = self.base or "gateway"
        done: Any
        if current.kind == "reasoning":
            done = reasoning_item(base, text)
            out = self._event("response.reasoning_text.done", **where, content_index=0, text=text)
        elif current.kind == "function":
            done = {**current.item, "status": "completed", "arguments": text}
            out = self._event(
                "response.function_call_arguments.done", **where, arguments=text, name=done["name"]
            )
        else:
            done = {**current.item, "input": text}
            out = self._event("response.custom_tool_call_input.done", **where, input=text)
        return out + self._event("response.output_item.done", output_index=current.index, item=done)


__all__ = ["ResponsesStream"]
