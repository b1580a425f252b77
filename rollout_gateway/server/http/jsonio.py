"""JSON in and out of the gateway, with orjson.

orjson (a dependency since issue 11) is several times faster than the standard library
on the large chat bodies the gateway handles every turn, and it closes a class of bad
input by construction: it rejects lone surrogates, ``NaN``/``Infinity`` literals, numbers
that overflow a double (``1e400``) and nesting deeper than 1024 levels with a
``JSONDecodeError`` (the standard library accepts the first three and raises
``RecursionError`` on the last), and it writes non-finite floats as ``null``. It writes
at most 254 levels, so request bodies are bounded tighter (:data:`MAX_BODY_DEPTH`).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson
from starlette.responses import Response

if TYPE_CHECKING:
    from rollout_gateway.server.http.body_prefix import BodyPrefix

#: Bodies larger than this are parsed in a worker thread so that one big request does
#: not stall every other rollout's turn on the event loop (orjson releases nothing, but a
#: thread lets the loop keep serving while the GIL switches every few milliseconds).
OFF_LOOP_PARSE_BYTES = 256 * 1024

JSONDecodeError = orjson.JSONDecodeError

#: Messages texts this long and longer are kept as a view into the depth check's text
#: and spliced into the upstream request (:class:`SplicedText`); shorter ones are cut
#: out into bytes: the splice's own work (some 8,000 instructions) costs more than
#: copying a short text twice.
SPLICE_MIN_BYTES = 16 * 1024

#: Deepest nesting of containers a request body may have (the body itself is level 1).
#: orjson reads 1024 levels but writes at most 254, and the gateway writes what it keeps
#: a few levels deeper than the agent sent it (a message sits 2 levels deeper in a
#: trajectory, a turn's ``stop`` 4): a body it can read but not write back was a 500 on
#: the turn, or a trajectory that could not be fetched.
MAX_BODY_DEPTH = 128
_ORJSON_MAX_DEPTH = 254


class TooDeepError(ValueError):
    """A request body nests deeper than :data:`MAX_BODY_DEPTH`."""


class UnwritableError(ValueError):
    """A value the gateway could not write back as JSON (an integer beyond 64 bits, a
    lone surrogate, nesting deeper than allowed): only the lenient parser of upstream
    answers builds such values."""


def loads(raw: bytes | str) -> Any:
    """Parse strict JSON (raises :class:`JSONDecodeError`, a ``ValueError``)."""
    return orjson.loads(raw)


def loads_body(raw: bytes | str) -> Any:
    """Parse a request body: strict JSON (:func:`loads`) that the gateway can write back
    wherever it keeps it (raises :class:`TooDeepError` past :data:`MAX_BODY_DEPTH`)."""
    value = orjson.loads(raw)
    check_depth(value)
    return value


class ConversationText(NamedTuple):
    """The JSON text of a request body's conversation list, as the depth check wrote it.

    ``text`` holds the list's JSON after ``head`` bytes (the depth check's wrapper's
    opening brackets, the body's other values and a marker) and before ``tail`` more
    (the closing brackets): kept as written, not cut out (a copy of the whole history). A dialect's
    parse compares it with the previous request's
    (:mod:`rollout_gateway.server.dialects.memo`): equal heads, then the same text up to
    the previous list's end, mean the same other values and the same leading items."""

    #: The body's field the list is (``messages``, or a Responses body's ``input``).
    field: str
    text: bytes
    head: int
    tail: int


class ParsedBody(NamedTuple):
    """A chat request body as :func:`loads_chat_body` parsed it."""

    value: Any
    #: ``dumps(value["messages"])`` (``None``: ``value`` is no object with a ``messages``
    #: list), a view into the depth check's text when long (not a copy: see
    #: :class:`SplicedText`). The messages are not changed after the parse: only other
    #: fields are.
    messages_text: bytes | memoryview | None = None
    #: The text of its ``input`` list (a Responses body; see :meth:`conversation_text`).
    conversation: ConversationText | None = None
    #: Where its conversation list is in its bytes, for the next body's parse
    #: (:func:`~.body_prefix.loads_extending` only).
    prefix: BodyPrefix | None = None

    def conversation_text(self) -> ConversationText | None:
        """The text of the body's ``input`` list, or of its ``messages`` list."""
        if self.conversation is None and self.messages_text is not None:
            return ConversationText("messages", bytes(self.messages_text), 0, 0)
        return self.conversation


def loads_chat_body(raw: bytes | str) -> ParsedBody:
    """:func:`loads_body`, and the text of the body's ``messages`` list, written by the
    depth check itself (one pass, not two): the history check and the upstream request use
    it instead of writing the messages again (at a 32k context, a pass over 32 kB). A
    body with an ``input`` list instead (OpenAI Responses) has that list written so too,
    kept uncut (:class:`ConversationText`)."""
    value = orjson.loads(raw)
    field = "messages"
    messages = value.get("messages") if type(value) is dict else None
    if messages is None and type(value) is dict:
        field = "input"
        messages = value.get("input")
    if type(messages) is not list:
        check_depth(value)
        return ParsedBody(value)
    last = _written_last(value, field, messages)
    if last is not None:
        written, head, tail = last
        if field == "input":
            return ParsedBody(value, None, ConversationText(field, written, head, tail))
        end = len(written) - tail
        if end - head < SPLICE_MIN_BYTES:
            return ParsedBody(value, written[head:end])
        # A view, not a copy: the upstream request is written around it (dumps_request).
        return ParsedBody(value, memoryview(written)[head:end])
    # Too deep or unwritable: the two-pass check raises as it always did. The list sits
    # one level below the body: written alone within MAX_BODY_DEPTH - 1 levels (a
    # TooDeepError says the body's bound); the rest checked without it.
    written = _written_within(messages, MAX_BODY_DEPTH - 1, MAX_BODY_DEPTH)
    value[field] = None
    try:
        check_depth(value)
    finally:
        value[field] = messages
    levels = _ORJSON_MAX_DEPTH - MAX_BODY_DEPTH + 1
    if field == "input":
        return ParsedBody(value, None, ConversationText(field, written, levels, levels))
    # (its ConversationText is made by a dialect's turn that needs it, not every chat turn)
    return ParsedBody(value, written[levels : len(written) - levels])


def _written_last(
    body: dict[str, Any], field: str, items: list[Any]
) -> tuple[bytes, int, int] | None:
    """``body``'s ``field`` list (``items``) written by one wrapped pass that checks the
    whole body's depth: the body's other values, then the list, in one list (as deep as
    the body: a dict and a list of its values nest alike). Returns the text written and
    how many bytes precede and follow the list's own text in it (the others' text,
    written alone and unwrapped: a few bytes in the usual body, says where the list
    starts). ``None`` when that pass fails (too deep): the two-pass check then raises as
    it always did.

    One wrapper chain a turn instead of two: writing the wrapper's 126 lists is most of
    a small body's depth check. The list's start is found by a marker written before it
    (:data:`_LIST_MARK`, a raw NUL byte: ``[a,b,\x00,[...]]``), not by writing the
    others alone first (a body whose other values are long, e.g. a Messages body's
    ``system`` prompt, was written twice)."""
    others = [v for k, v in body.items() if k != field]
    others.append(_LIST_MARK)
    others.append(items)
    try:
        written = _written_within(others, MAX_BODY_DEPTH, MAX_BODY_DEPTH)
    except (TypeError, ValueError):  # (orjson's JSONEncodeError is a TypeError)
        return None
    levels = _ORJSON_MAX_DEPTH - MAX_BODY_DEPTH
    return written, written.index(0, levels) + 2, levels + 1


#: Written just before a body's conversation list by :func:`_written_last`, and in place
#: of a value by :func:`written_around`: orjson writes a raw NUL byte only from a
#: fragment (in strings it is ``\u0000``), so the text's first NUL is this one.
_LIST_MARK = orjson.Fragment(b"\x00")


def check_depth(value: Any, max_depth: int = MAX_BODY_DEPTH) -> None:
    """Raise :class:`TooDeepError` when ``value`` nests deeper than ``max_depth``.

    Written by orjson inside ``254 - max_depth`` lists, ``value`` fails exactly then: one
    pass in C (a 170 kB chat body takes ~10 us), not a walk of every node in Python.
    """
    _written_within(value, max_depth, max_depth, keep=False)


def written_checked(value: Any, max_depth: int = MAX_BODY_DEPTH) -> bytes:
    """orjson's writing of ``value``, checked as :func:`check_depth` checks it, in the
    same pass (raises :class:`TooDeepError` as it does)."""
    levels = _ORJSON_MAX_DEPTH - max_depth
    written = _written_within(value, max_depth, max_depth)
    return written[levels : len(written) - levels]


def _written_within(value: Any, max_depth: int, reported: int, keep: bool = True) -> bytes:
    """``dumps(value)`` (with ``keep``) inside ``254 - max_depth`` lists, which fails
    exactly when ``value`` nests deeper than ``max_depth`` (see :func:`check_depth`; a
    :class:`TooDeepError` says ``reported`` levels)."""
    levels = _ORJSON_MAX_DEPTH - max_depth
    pool = _wrapper_chains.get(max_depth)
    chain = None
    if pool is not None:
        try:  # (not contextlib.suppress: its object and calls, every turn)
            chain = pool.pop()
        except IndexError:  # none free: a new one
            pass
    if chain is None:
        chain = _wrapper_chain(levels)
    outer, inner = chain
    inner[0] = value
    try:
        written = orjson.dumps(outer)
    except orjson.JSONEncodeError as exc:
        if "Recursion" not in str(exc):
            raise UnwritableError(str(exc)) from None
        raise TooDeepError(f"request body nests deeper than {reported} levels") from None
    finally:
        inner[0] = None
        if pool is not None:
            pool.append(chain)
    return written if keep else b""


def check_writable(value: Any, max_depth: int = MAX_BODY_DEPTH) -> None:
    """Raise :class:`UnwritableError` unless the gateway can write ``value`` back as JSON
    wherever it keeps it (see :data:`MAX_BODY_DEPTH`): no integer beyond 64 bits, no
    lone surrogate, no nesting deeper than ``max_depth``. One pass in C."""
    try:
        check_depth(value, max_depth)
    except TooDeepError:
        raise UnwritableError(f"nests deeper than {max_depth} levels") from None


def _wrapper_chain(levels: int) -> tuple[list[Any], list[Any]]:
    """``levels`` nested one-element lists: the outermost and the innermost."""
    inner: list[Any] = [None]
    outer = inner
    for _ in range(levels - 1):
        outer = [outer]
    return outer, inner


#: Deepest nesting of what the gateway keeps of an engine's answer (a choice's message,
#: the usage) inside a list of them: kept at most 8 levels deeper (a message in a step's
#: ``extras.other_choices``), they are written back within orjson's 254.
MAX_KEPT_ANSWER_DEPTH = 245

#: Wrapper chains of :func:`check_depth` for the depths it checks every turn, reused:
#: building one is half its cost on a chat body. Each is taken by one call at a time
#: (``list.pop`` and ``append`` are atomic), so bodies parsed in worker threads get their
#: own.
_wrapper_chains: dict[int, list[tuple[list[Any], list[Any]]]] = {
    MAX_BODY_DEPTH: [],
    MAX_BODY_DEPTH - 1: [],  # a chat body's messages (loads_chat_body)
    MAX_KEPT_ANSWER_DEPTH: [],
}


async def loads_off_loop(raw: bytes) -> Any:
    """Like :func:`loads_body`; bodies over :data:`OFF_LOOP_PARSE_BYTES` parse in a thread."""
    if len(raw) > OFF_LOOP_PARSE_BYTES:
        return await asyncio.to_thread(loads_body, raw)
    return loads_body(raw)


def spliced_history(text: bytes) -> bytes | memoryview:
    """A request's messages text (``dumps(messages)``) as the upstream request takes it:
    from :data:`SPLICE_MIN_BYTES` on, a view of it, which :func:`dumps_request` writes
    around (:class:`SplicedText`) instead of copying it into orjson's output as a
    fragment (the same bytes); a shorter one as it is."""
    return memoryview(text) if len(text) >= SPLICE_MIN_BYTES else text


def loads_lenient(raw: bytes) -> Any:
    """Parse an upstream's answer: strict first, then the standard library.

    Engines written in Python serialise a ``-inf`` logprob as ``-Infinity`` (not JSON);
    the answer is still the engine's and must be recorded, not refused.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Serialise to compact JSON bytes (non-finite floats become ``null``)."""
    return orjson.dumps(value)


class SplicedText:
    """A JSON text that :func:`dumps_request` writes into a body as it is, like an
    :class:`orjson.Fragment`, but from a view: a request's messages as the intake's
    depth check wrote them, inside that check's wrapper. A fragment needs bytes of its
    own, a copy of the whole history cut out of the wrapper's text, which the upstream
    request's writing then copies again: one copy instead of two per turn."""

    __slots__ = ("text",)

    def __init__(self, text: memoryview) -> None:
        self.text = text


def written_around(body: dict[str, Any], field: str) -> tuple[bytes, int]:
    """``body`` written with a mark (a raw NUL byte) in place of its ``field`` value, and
    where the mark is: the text before and after that value, whatever it is (orjson
    writes a raw NUL only from a fragment; in strings it is ``\u0000``)."""
    value = body[field]
    body[field] = _LIST_MARK
    try:
        written = orjson.dumps(body)
    finally:
        body[field] = value
    return written, written.index(0)


def dumps_request(body: dict[str, Any]) -> bytes:
    """:func:`dumps` of a request body whose ``messages`` may be a :class:`SplicedText`
    (the same bytes as with a fragment of its text): :func:`dumps_request_pieces` joined."""
    return b"".join(dumps_request_pieces(body))


def dumps_request_pieces(body: dict[str, Any]) -> tuple[bytes | memoryview, ...]:
    """A request body's JSON (see :func:`dumps_request`) in pieces: the body written with
    a mark where a :class:`SplicedText` goes, cut around it, and the text between. A
    transport writes them as they are (one ``writelines``), where a join would copy the
    whole history once more per turn."""
    messages = body.get("messages")
    if type(messages) is not SplicedText:
        return (orjson.dumps(body),)
    written, at = written_around(body, "messages")
    view = memoryview(written)
    return view[:at], messages.text, view[at + 1 :]


class JSONBytesResponse(Response):
    """A JSON response serialised with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """Serialise ``content``."""
        return orjson.dumps(content)


__all__ = [
    "MAX_BODY_DEPTH",
    "MAX_KEPT_ANSWER_DEPTH",
    "OFF_LOOP_PARSE_BYTES",
    "SPLICE_MIN_BYTES",
    "ConversationText",
    "JSONBytesResponse",
    "ParsedBody",
    "SplicedText",
    "JSONDecodeError",
    "TooDeepError",
    "UnwritableError",
    "check_depth",
    "check_writable",
    "dumps",
    "dumps_request",
    "dumps_request_pieces",
    "loads",
    "loads_body",
    "loads_chat_body",
    "loads_lenient",
    "loads_off_loop",
    "spliced_history",
    "written_around",
    "written_checked",
]
