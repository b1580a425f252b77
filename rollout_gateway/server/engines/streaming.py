"""True streaming from the engine: relay chunks to the agent, rebuild the whole answer.

vLLM (``stream: true`` with ``return_token_ids`` and ``logprobs``) sends the prompt's ids
on the first chunk, each chunk's new ``token_ids`` and ``logprobs.content`` entries on
its choice (a chunk is sent for every token batch even when it carries no text), the
``finish_reason`` / ``stop_reason`` on the last chunk of a choice, and the ``usage``
alone on a final chunk when ``stream_options.include_usage`` is set.
:class:`StreamAssembler` folds those chunks back into the ``chat.completion`` dict a
non-streamed request would have got, so the turn is recorded exactly as complete.
:func:`agent_chunk` trims each chunk to what the agent asked for.

The prompt's ids stay text, as in a whole answer (:mod:`~..recording.prompt_ids`): the
first chunk's ``prompt_token_ids`` is cut out before the chunk is parsed and carried as
an :class:`orjson.Fragment` (written back as it came, never parsed here: at a 32k context,
parsing it into ints, checking it, writing it again for the agent and converting it for
the recorder cost several times the rest of the turn); the recorder reads only the ids
after the previous prompt's. The stream is read as bytes, never decoded (:func:`iter_sse_json`),
and a chunk relayed unchanged is relayed as the bytes the engine wrote.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_gateway.protocol import error_code
from rollout_gateway.server.engines.upstream import agent_status
from rollout_gateway.server.engines.upstream_http import line_spans
from rollout_gateway.server.http import jsonio

#: An SSE comment line: clients ignore it, proxies and tunnels see traffic.
KEEPALIVE_EVENT = b": keepalive\n\n"


class StreamError(Exception):
    """The engine reported an error inside the stream (``data: {"error": ...}``), or sent
    an event that is not a chat completion chunk.

    ``message`` and ``status_code`` are what the agent gets, mapped as a whole answer's
    error status is (:func:`~.upstream.agent_status`): an engine error of 5xx is a 502
    whose message is only its status, the engine's own words going to ``detail`` (the
    operator's log); of 4xx a 400 (404 and 429 kept) with its message.
    """

    def __init__(self, message: str, status_code: int = 502, detail: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.detail = detail or message


class StreamChunk(dict[str, Any]):
    """A parsed ``chat.completion.chunk``, with the engine's bytes of it (:attr:`payload`:
    what :func:`sse_event` relays while the chunk is unchanged; ``None`` when it came on
    several ``data:`` lines). Its ``prompt_token_ids``, when it has them, are an
    :class:`orjson.Fragment` of their JSON text, :attr:`ids_text` (see the module
    docstring)."""

    __slots__ = ("_buffer", "_line", "_start", "_stop", "ids_text")

    def __init__(
        self,
        value: dict[str, Any],
        buffer: bytes | None,
        line: int,
        data: tuple[int, int],
        ids_text: bytes | None,
    ) -> None:
        super().__init__(value)
        #: The event's data is ``buffer[start:stop]``, its line starts at ``line``
        #: (``buffer`` ``None``: not relayed as it came).
        self._buffer, self._line = buffer, line
        self._start, self._stop = data
        self.ids_text = ids_text

    @property
    def payload(self) -> bytes | None:
        """The event's data as the engine wrote it (cut out of its buffer when asked: at a
        32k context the first chunk's line is 224 kB, and only a chunk relayed unchanged
        needs it)."""
        buffer = self._buffer
        return None if buffer is None else buffer[self._start : self._stop]

    def event(self) -> bytes | None:
        """The chunk's SSE event as the engine wrote it: the bytes it came in when they are
        ``data: `` + the data + a blank line (the event's bytes are then the buffer's, not
        copied again when they are the whole buffer), else framed once."""
        buffer = self._buffer
        if buffer is None:
            return None
        line, start, stop = self._line, self._start, self._stop
        if (
            start == line + 6
            and buffer.startswith(b"data: ", line)
            and (buffer.startswith(b"\n\n", stop))
        ):
            return buffer if line == 0 and stop + 2 == len(buffer) else buffer[line : stop + 2]
        return b"".join((b"data: ", memoryview(buffer)[start:stop], b"\n\n"))


class StreamedCompletion(dict[str, Any]):
    """The ``chat.completion`` a stream adds up to (:meth:`StreamAssembler.completion`).
    Its ``prompt_token_ids``, when a chunk carried them as text, are an
    :class:`orjson.Fragment` of :attr:`prompt_ids_json` (read by
    :func:`~.answers.read_answer` for the recorder)."""

    __slots__ = ("prompt_ids_json",)

    def __init__(self, value: dict[str, Any], prompt_ids_json: bytes | None) -> None:
        super().__init__(value)
        self.prompt_ids_json = prompt_ids_json


async def iter_sse_json(body: AsyncIterator[bytes]) -> AsyncIterator[StreamChunk]:
    """The JSON payloads of an SSE stream's ``data:`` events, up to ``[DONE]``, read from
    the body's bytes (:meth:`~.upstream_http.UpstreamStream.chunks`): lines are found in
    the bytes and parsed there, never decoded to text (at a 32k context the first event
    is a 224 kB line).

    Raises :class:`StreamError` on an error event or a payload that is not JSON.
    """
    data: list[tuple[bytes, int, int]] = []  # the event's data: lines, whole (see _event)
    async for buffer, start, stop in line_spans(body):
        if buffer.startswith(b"data:", start, stop):
            data.append((buffer, start, stop))
            continue
        if not data or (stop > start and _text(buffer[start:stop]).strip()):
            continue  # comments, event names, or a blank line with no data
        chunk, data = _event(data), []
        if chunk is None:
            return
        yield chunk
    if data:
        chunk = _event(data)
        if chunk is not None:
            yield chunk


def _text(data: bytes | memoryview) -> str:
    return str(data, "utf-8", "replace")


def _data_start(buffer: bytes, line: int, stop: int) -> int:
    """Where a ``data:`` line's value starts (after the field name and its spaces)."""
    start = line + 5
    while buffer.startswith(b" ", start, stop):
        start += 1
    return start


#: Longest ``[DONE]`` event checked for as such (with the spaces around it).
_DONE_LEN = 64


def _event(data: list[tuple[bytes, int, int]]) -> StreamChunk | None:
    """One event's chunk (``None``: ``[DONE]``). A one-line event is read in its buffer,
    not copied out of it: the prompt's ids are cut out of the buffer itself, and the
    chunk relayed unchanged is those bytes (:meth:`StreamChunk.event`)."""
    line: int | None
    if len(data) == 1:
        buffer, line, stop = data[0]
        start = _data_start(buffer, line, stop)
        if stop - start <= _DONE_LEN and _text(buffer[start:stop]).strip() == "[DONE]":
            return None
    else:
        buffer = b"\n".join(b[_data_start(b, at, end) : end] for b, at, end in data)
        line, start, stop = None, 0, len(buffer)
        if _text(buffer).strip() == "[DONE]":
            return None
    try:
        return _decode(buffer, line, start, stop)
    except _NotUTF8:  # read, and relayed, with it replaced: the text it was read as before
        replaced = _text(buffer[start:stop]).encode()
        return _decode(replaced, None, 0, len(replaced))


class _NotUTF8(Exception):
    """A payload orjson refused that is not UTF-8 (see :func:`_event`)."""


_IDS_KEY = b'"prompt_token_ids"'


#: Data longer than this is read through a view of its buffer, not cut out (shorter, a
#: copy costs less than making the view).
_VIEW_MIN = 4096


def _data(buffer: bytes, start: int, stop: int) -> bytes | memoryview:
    return buffer[start:stop] if stop - start < _VIEW_MIN else memoryview(buffer)[start:stop]


def _split_ids(buffer: bytes, start: int, stop: int) -> tuple[bytes | memoryview, bytes | None]:
    """``buffer[start:stop]`` with its ``"prompt_token_ids": [...]`` array replaced by
    ``null``, and the array's bytes (as :func:`~..recording.prompt_ids.split_prompt_ids`)."""
    key_at = buffer.find(_IDS_KEY, start, stop)
    if key_at < 0:
        return _data(buffer, start, stop), None
    open_at = buffer.find(b"[", key_at + len(_IDS_KEY), stop)
    if open_at < 0 or buffer[key_at + len(_IDS_KEY) : open_at].strip() != b":":
        return _data(buffer, start, stop), None
    close_at = buffer.find(b"]", open_at, stop)
    if close_at < 0:
        return _data(buffer, start, stop), None
    rest = b"".join((buffer[start:open_at], b"null", buffer[close_at + 1 : stop]))
    return rest, buffer[open_at : close_at + 1]


def _parse(payload: bytes | memoryview) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        pass  # NaN / Infinity (engines written in Python), or not JSON: the lenient parser
    try:
        text = str(payload, "utf-8")
    except UnicodeDecodeError:
        raise _NotUTF8 from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise StreamError(
            "upstream sent a stream event that is not JSON", detail=f"{exc}: {text[:200]!r}"
        ) from None


def _decode(buffer: bytes, line: int | None, start: int, stop: int) -> StreamChunk:
    """The chunk of the event whose data is ``buffer[start:stop]`` (its line starting at
    ``line``; ``None``: not relayed as it came)."""
    rest, ids = _split_ids(buffer, start, stop)
    if ids is None:
        value = _parse(rest)
    else:
        value = _parse_without_ids(rest, buffer, start, stop)
        if isinstance(value, dict) and value.get("prompt_token_ids", 0) is not None:
            # the array cut out was not the top-level one
            value, ids = _parse(memoryview(buffer)[start:stop]), None
    if not isinstance(value, dict):
        raise StreamError("upstream sent a stream event that is not an object")
    try:  # the chunk is relayed, and recorded: no value JSON cannot carry back
        jsonio.check_writable(value)
    except jsonio.UnwritableError as exc:
        raise StreamError("upstream answer is malformed", detail=f"stream event: {exc}") from None
    if ids is not None:
        value["prompt_token_ids"] = orjson.Fragment(ids)
    relayed = buffer if line is not None else None
    chunk = StreamChunk(value, relayed, line or 0, (start, stop), ids)
    if "error" in value:
        _raise_for_error(chunk)
    choices = chunk.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise StreamError("upstream sent a stream event that is not a chat completion chunk")
    for choice in choices or ():
        problem = _chunk_choice_problem(choice)
        if problem is not None:  # relayed as it is, it would differ from what is recorded
            raise StreamError("upstream answer is malformed", detail=f"stream event: {problem}")
    return chunk


def _raise_for_error(chunk: StreamChunk) -> None:
    """Raise the engine's error when the chunk is one (``{"error": ...}``)."""
    error = chunk.get("error")
    if error is None:
        return
    message = error.get("message") if isinstance(error, Mapping) else str(error)
    code = error.get("code") if isinstance(error, Mapping) else None
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    detail = f"upstream error {status} in stream: {message}"
    if status >= 500:
        raise StreamError(f"upstream error {status}", agent_status(status), detail)
    raise StreamError(f"upstream error in stream: {message}"[:2000], agent_status(status), detail)


def _parse_without_ids(rest: bytes | memoryview, buffer: bytes, start: int, stop: int) -> Any:
    """The chunk without its prompt ids (``null``); the whole event (ids parsed) when
    cutting them out did not leave JSON (an array not of plain ids)."""
    try:
        return _parse(rest)
    except StreamError:
        return _parse(memoryview(buffer)[start:stop])


#: Text fields of a chunk's ``delta``.
_DELTA_TEXT = ("role", "content", "reasoning", "reasoning_content")


def _chunk_choice_problem(choice: Any) -> str | None:
    """What is wrong with one choice of a chunk (``None``: nothing)."""
    # dict, not Mapping: chunks are parsed JSON (an ABC's isinstance is slow per chunk).
    if not isinstance(choice, dict):
        return "a choice is not an object"
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        return "finish_reason is not text"
    delta = choice.get("delta")
    if delta is None:
        return None
    if not isinstance(delta, dict):
        return "delta is not an object"
    for key in _DELTA_TEXT:
        if delta.get(key) is not None and not isinstance(delta[key], str):
            return f"delta.{key} is not text"
    calls = delta.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
    ):
        return "delta.tool_calls is not a list of objects"
    return None


@dataclass
class _Choice:
    index: int
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] | None = None
    logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None

    def feed(self, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, Mapping):
            if isinstance(delta.get("role"), str):
                self.role = delta["role"]
            if isinstance(delta.get("content"), str):
                self.content = (self.content or "") + delta["content"]
            text = delta.get("reasoning")
            if not isinstance(text, str):
                text = delta.get("reasoning_content")
            if isinstance(text, str):
                self.reasoning = (self.reasoning or "") + text
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                if isinstance(call, Mapping):
                    self._feed_call(call)
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids = (self.token_ids or []) + ids
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, Mapping) and isinstance(logprobs.get("content"), list):
            self.logprobs = (self.logprobs or []) + logprobs["content"]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]

    def _feed_call(self, call: Mapping[str, Any]) -> None:
        position = call.get("index")
        position = position if isinstance(position, int) else len(self.tool_calls)
        entry = self.tool_calls.setdefault(
            position, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if call.get("id"):
            entry["id"] = call["id"]
        if call.get("type"):
            entry["type"] = call["type"]
        function = call.get("function")
        if isinstance(function, Mapping):
            if isinstance(function.get("name"), str):
                entry["function"]["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                entry["function"]["arguments"] += function["arguments"]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            message["reasoning"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[k] for k in sorted(self.tool_calls)]
        return message


@dataclass
class StreamAssembler:
    """Folds streamed ``chat.completion.chunk`` dicts into one ``chat.completion``."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    #: The ids, or their text as a fragment (see the module docstring) ...
    prompt_token_ids: list[int] | orjson.Fragment | None = None
    #: ... then that text.
    prompt_ids_json: bytes | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0
    _choices: dict[int, _Choice] = field(default_factory=dict)

    def feed(self, chunk: Mapping[str, Any]) -> None:
        """Add one chunk."""
        self.chunks += 1
        self.id = self.id or chunk.get("id")
        self.created = self.created or chunk.get("created")
        self.model = self.model or chunk.get("model")
        ids = chunk.get("prompt_token_ids")
        if isinstance(ids, list):
            self.prompt_token_ids, self.prompt_ids_json = ids, None
        elif isinstance(ids, orjson.Fragment) and isinstance(chunk, StreamChunk) and chunk.ids_text:
            self.prompt_token_ids, self.prompt_ids_json = ids, chunk.ids_text
        if isinstance(chunk.get("usage"), Mapping):
            self.usage = dict(chunk["usage"])
        for position, choice in enumerate(chunk.get("choices") or ()):
            if not isinstance(choice, Mapping):
                continue
            index = choice.get("index")
            index = index if isinstance(index, int) else position
            self._choices.setdefault(index, _Choice(index)).feed(choice)

    @property
    def finished(self) -> bool:
        """Whether every choice seen has its finish reason."""
        return bool(self._choices) and all(
            c.finish_reason is not None for c in self._choices.values()
        )

    def completion(self) -> StreamedCompletion:
        """The ``chat.completion`` the chunks add up to."""
        choices = []
        for index in sorted(self._choices):
            c = self._choices[index]
            choice: dict[str, Any] = {
                "index": index,
                "message": c.message(),
                "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.token_ids is not None:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        out: dict[str, Any] = {
            "id": self.id or "chatcmpl-gateway",
            "object": "chat.completion",
            "created": self.created or 0,
            "model": self.model or "",
            "choices": choices,
            "usage": self.usage,
        }
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return StreamedCompletion(out, self.prompt_ids_json)


def agent_chunk(
    chunk: dict[str, Any], body: Mapping[str, Any], *, include_usage: bool
) -> dict[str, Any] | None:
    """``chunk`` as the agent asked for it (``None``: nothing to send).

    Token ids only with ``return_token_ids``, logprobs only with ``logprobs``, usage only
    with ``stream_options.include_usage`` (the gateway always asks the engine for usage),
    reasoning dropped when the agent sent ``include_reasoning: false`` (the gateway
    always asks the engine for it, to record its tokens).
    """
    want_ids = bool(body.get("return_token_ids"))
    want_logprobs = bool(body.get("logprobs"))
    hide_reasoning = body.get("include_reasoning") is False
    choices = chunk.get("choices") or []
    if not include_usage and not choices and "usage" in chunk:
        return None  # the usage-only chunk the agent did not ask for
    if want_ids and want_logprobs and include_usage and not hide_reasoning:
        return chunk
    out = dict(chunk)
    if not want_ids:
        out.pop("prompt_token_ids", None)
    if not include_usage:
        out.pop("usage", None)
    trimmed = []
    for choice in choices:
        if isinstance(choice, dict):
            choice = dict(choice)
            if not want_ids:
                choice.pop("token_ids", None)
            if not want_logprobs:
                choice["logprobs"] = None
            delta = choice.get("delta")
            if hide_reasoning and isinstance(delta, dict):
                hidden = ("reasoning", "reasoning_content")
                choice["delta"] = {k: v for k, v in delta.items() if k not in hidden}
        trimmed.append(choice)
    out["choices"] = trimmed
    return out


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One SSE ``data:`` event: a :class:`StreamChunk` as the engine wrote it, anything
    else written with orjson (non-finite numbers as ``null``)."""
    if type(payload) is StreamChunk:
        event = payload.event()  # the bytes the engine wrote (no decode, no re-encode)
        if event is not None:
            return event
    return b"".join((b"data: ", jsonio.dumps(payload), b"\n\n"))


def sse_error_event(message: str, status_code: int, error_type: str) -> bytes:
    """An error event in the shape the OpenAI SDK raises from inside a stream (``code``:
    the status's name, a string like every ``error.code`` of the gateway)."""
    error = {"message": message, "type": error_type, "code": error_code(status_code)}
    return sse_event({"error": error})


class EventLog:
    """The SSE events of one turn, kept for every request waiting on it.

    The turn appends events as the engine sends them; each waiting request (the original
    and any retry that joins the turn) follows the log from its start, so a retry that
    arrives mid-stream still gets the whole answer. While no event comes for
    ``keepalive_s``, a follower gets :data:`KEEPALIVE_EVENT` instead. Once the log is
    closed and nobody follows it, its events are dropped (a retry arriving after the turn
    ended is answered from the turn's answer instead): a rollout does not keep its last
    turn's chunks.
    """

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.closed = False
        #: Requests following the log (see :meth:`release`).
        self.followers = 0
        #: Whether the engine's chunks were relayed (else the answer is re-encoded).
        self.relayed = False
        #: The followers waiting for the next event (each a bare future: no task is made
        #: per event, as ``asyncio.wait_for`` would make one).
        self._waiters: list[asyncio.Future[bool]] = []

    def release(self) -> None:
        """A follower is done with the log."""
        self.followers -= 1
        self._drop_if_unused()

    def _drop_if_unused(self) -> None:
        if self.closed and self.followers <= 0:
            self.events = []

    def append(self, event: bytes) -> None:
        """Add one event (wakes the followers)."""
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        """No more events will come."""
        self.closed = True
        self._wake()
        self._drop_if_unused()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(True)

    async def wait(self, timeout_s: float) -> bool:
        """Wait for an event or the close, at most ``timeout_s``; whether one came."""
        if self.closed:
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(timeout_s, _time_out, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            if waiter in self._waiters:  # timed out or cancelled: not woken
                self._waiters.remove(waiter)

    async def follow(
        self, keepalive_s: float, keepalive: bytes = KEEPALIVE_EVENT
    ) -> AsyncIterator[bytes]:
        """Every event from the first, then each as it comes, until the log closes
        (``keepalive`` while the engine is silent: each dialect's own)."""
        position = 0
        while True:
            while position < len(self.events):
                position += 1
                yield self.events[position - 1]
            if self.closed:
                return
            if not await self.wait(keepalive_s):
                yield keepalive


def _time_out(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


__all__ = [
    "KEEPALIVE_EVENT",
    "EventLog",
    "StreamAssembler",
    "StreamChunk",
    "StreamError",
    "StreamedCompletion",
    "agent_chunk",
    "iter_sse_json",
    "sse_error_event",
    "sse_event",
]
