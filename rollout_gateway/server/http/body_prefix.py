"""A dialect request body parsed from the previous one's: its repeated history not parsed again.

An agent sends the whole conversation every turn, and a Messages or Responses body holds
about three times the JSON objects of the same chat body: orjson builds every one of
them, the depth check writes them all again, and the next turn frees them (and a
Messages body's long system prompt, a string outside the list, is built and compared
again). So the rollout keeps its previous body's bytes, where its conversation list
starts and ends in them, the list as parsed and the body's other values
(:class:`BodyPrefix`). A body that repeats those bytes up to the list's last item, then
adds items (``,`` and more), then ends with the previous body's bytes from the list's
closing bracket on, is the previous body with items added: only the new items are
parsed (and depth-checked); the body is a new dict of the previous body's other values
(the very objects, as the list's previous items are) and a new list of the previous
items and the new ones. A body whose bytes after the list differ (new metadata every
turn) has what follows the repeated bytes parsed alone (:func:`_tail_changed`); one whose
list's last item was rewritten (a cache breakpoint moved from it to the newest message)
has that item and those after it parsed (:func:`_last_replaced`). After
:data:`MAX_MISSES` bodies in a row that extend nothing, a rollout is not tried again.
Anything else is parsed whole (:func:`~.jsonio.loads_chat_body`),
which raises as it always did.

Exact: the bytes before the list's end and after it are the previous body's, and the
new items' text parsed alone as ``[`` + text + ``]`` is one list (brackets balanced:
the list closes where the previous body's did), so the whole body is the previous body's
values with those items added, as a parse of it would build. A body starts a chain only
when it is exactly orjson's writing of what it parsed to (compact, no repeated key: the
Python and JavaScript SDKs write so), so that where its list starts and ends is known;
the bodies after it need not be (their new items' text is parsed as it is). The values
are shared from turn to turn, as the dialect's memo shares them already: nothing changes
a body's values after its parse (its dict and its list are the caller's own).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_gateway.server.http.jsonio import (
    MAX_BODY_DEPTH,
    ParsedBody,
    check_depth,
    loads_chat_body,
    written_around,
    written_checked,
)


@dataclass(frozen=True, slots=True)
class BodyPrefix:
    """A body's bytes and its conversation list in them (see the module docstring)."""

    #: The body as the agent sent it.
    raw: bytes
    #: Where the list's opening bracket is in ``raw``.
    start: int
    #: Where its closing bracket is (the previous body's bytes before it are repeated).
    end: int
    #: The body's field the list is (``input``, ``messages``).
    field: str
    #: The list as parsed (its items are never changed after the parse): a copy of the
    #: body's list, never handed out itself.
    items: list[Any]
    #: The body's values as parsed, in its order (its list's value stale): a copy of
    #: the one handed out, never handed out itself.
    others: dict[str, Any]
    #: How many bodies in a row before this one did not extend their previous one.
    misses: int = 0


def loads_extending(raw: bytes, previous: BodyPrefix | None = None) -> ParsedBody:
    """:func:`~.jsonio.loads_chat_body` of ``raw``, with its :class:`BodyPrefix`
    (:attr:`~.jsonio.ParsedBody.prefix`) for the next body: only the items after
    ``previous``'s parsed when ``raw`` repeats it (then without the conversation's
    text: the dialect's memo finds the repeated items by identity)."""
    if previous is UNWRITTEN:  # the rollout's bodies are not orjson's writing
        return loads_chat_body(raw)._replace(prefix=UNWRITTEN)
    if previous is not None:
        parsed = _extended(raw, previous)
        if parsed is not None:
            return parsed
    parsed = loads_chat_body(raw)
    misses = 0 if previous is None else previous.misses + 1
    if misses >= MAX_MISSES:  # this agent's bodies do not extend each other: stop trying
        return parsed._replace(prefix=UNWRITTEN)
    return parsed._replace(prefix=_prefix_of(raw, parsed, misses))


def _extended(raw: bytes, previous: BodyPrefix) -> ParsedBody | None:
    """``raw`` parsed as ``previous``'s body with items added, the bytes after the list
    the same or not (``None``: it is not such a body)."""
    if not previous.items:  # "[" then "," would be no JSON: such a list starts no chain
        return None
    before, end = previous.raw, previous.end
    if len(raw) <= end or not raw.startswith(memoryview(before)[:end]):
        return _last_replaced(raw, previous)
    close = len(raw) - (len(before) - end)  # where the list closes if what follows is the same
    if close >= end and raw.endswith(memoryview(before)[end:]):
        parsed = _items_added(raw, previous, close)
        if parsed is not None:
            return parsed
    return _tail_changed(raw, previous)


def _items_added(raw: bytes, previous: BodyPrefix, close: int) -> ParsedBody | None:
    """``raw``: ``previous``'s bytes with items before its list's end (at ``close``)."""
    end = previous.end
    if close == end:  # the same list
        return _chained(raw, previous, close, previous.items)
    if raw[end] != _COMMA:  # (an index: an int, no slice)
        return None
    added = _items_of(memoryview(raw)[end + 1 : close])
    if not added:  # "[a,]": the comma of no item, which a whole parse refuses
        return None
    return _chained(raw, previous, close, previous.items + added)


def _last_replaced(raw: bytes, previous: BodyPrefix) -> ParsedBody | None:
    """``raw``: ``previous``'s bytes up to its list's last item, that item rewritten and
    items after it, then ``previous``'s bytes from its list's end on (Claude Code moves
    its cache breakpoint from the last message to the newest every turn, and rewrites a
    system message it marked as a string). The rewritten item and the new ones are
    parsed as ``[`` + text + ``]``: one list, so the brackets close where the previous
    body's did; the items before it are the previous body's. Where that item starts is
    found only now (a body that extends its previous one never needs it)."""
    end, before = previous.end, previous.raw
    last = _last_start(before, end, previous.items)
    if last is None:
        return None
    close = len(raw) - (len(before) - end)  # where the list closes if what follows is the same
    if (
        close < last
        or not raw.startswith(memoryview(before)[:last])
        or not raw.endswith(memoryview(before)[end:])
    ):
        return None
    rest = _items_of(memoryview(raw)[last:close])
    if rest is None or (not rest and len(previous.items) > 1):  # "[a,]": a comma of no item
        return None
    return _chained(raw, previous, close, previous.items[:-1] + rest)


def _items_of(text: memoryview) -> list[Any] | None:
    """The items of a list's text (between its brackets, the list one level below the
    body), parsed as ``[`` + text + ``]`` and depth-checked; ``None`` when they are not
    (the whole parse then raises its own error)."""
    try:
        items = orjson.loads(b"".join((b"[", text, b"]")))
        check_depth(items, MAX_BODY_DEPTH - 1)
    except ValueError:  # (JSONDecodeError, TooDeepError)
        return None
    return items


def _chained(raw: bytes, previous: BodyPrefix, close: int, items: list[Any]) -> ParsedBody:
    """``raw`` as ``previous``'s body with its list ``items`` (closing at ``close``): the
    same bytes around the list, the same values (the previous body's very objects)."""
    field, others = previous.field, previous.others
    value = others.copy()
    value[field] = items.copy()  # (the caller's own list, as the dict is)
    return ParsedBody(value, prefix=BodyPrefix(raw, previous.start, close, field, items, others))


def _last_start(raw: bytes, close: int, items: list[Any]) -> int | None:
    """Where ``items``' last one starts in ``raw``, the list closing at ``close``, when
    it is written as orjson writes it (``None``: it is not, or there is none). A JSON
    value's text that ends where the list's last item ends, right after a ``,`` or the
    list's ``[``, is that item's whole text (brackets balance)."""
    if not items:
        return None
    written = orjson.dumps(items[-1])
    start = close - len(written)
    if start < 1 or raw[start - 1] not in _ITEM_BEFORE or not raw.startswith(written, start):
        return None
    return start


def _tail_changed(raw: bytes, previous: BodyPrefix) -> ParsedBody | None:
    """``raw``: ``previous``'s bytes up to its list's last item, then items or none,
    the list's end and values of its own (an agent that writes new metadata after its
    history every turn: Codex's ``client_metadata``). What follows the repeated bytes is
    parsed as an object whose first value is the list's rest; the values before the list
    are the previous body's. A chain goes on only when those values are written as
    orjson writes them (the next body's list end is then known)."""
    end = previous.end
    mark = raw[end]
    if mark != _COMMA and mark != _CLOSE:
        return None
    rest = memoryview(raw)[end + 1 if mark == _COMMA else end :]
    try:
        tail = orjson.loads(b"".join((_TAIL_OPEN, rest)))
    except ValueError:
        return None
    if type(tail) is not dict or next(iter(tail)) != _TAIL_KEY:
        return None
    added = tail.pop(_TAIL_KEY)
    if type(added) is not list or (mark == _COMMA and not added):  # "[a,]" is no JSON
        return None
    field, others = previous.field, previous.others
    keys = list(others)
    head = keys[: keys.index(field)]
    if field in tail or not tail.keys().isdisjoint(head):  # a repeated key: parsed whole
        return None
    try:
        check_depth(added, MAX_BODY_DEPTH - 1)
        written = written_checked(tail)  # (checked and written in one pass)
    except ValueError:
        return None
    after = b"]," + written[1:] if tail else b"]}"
    if not raw.endswith(after):  # not orjson's writing: where the list ends is not known
        return None
    value = {key: others[key] for key in head}
    items = previous.items + added if added else previous.items
    value[field] = items.copy()
    value.update(tail)
    close = len(raw) - len(after)
    return ParsedBody(
        value, prefix=BodyPrefix(raw, previous.start, close, field, items, value.copy())
    )


def _prefix_of(raw: bytes, parsed: ParsedBody, misses: int) -> BodyPrefix | None:
    """``raw``'s :class:`BodyPrefix` when ``raw`` is exactly orjson's writing of
    ``parsed`` (the list's place then known); :data:`UNWRITTEN` when it is not (an agent
    writes every body alike: its next ones are not tried, which costs a write of the
    body's other values, a long system prompt among them); ``None`` when it has no
    conversation list."""
    value = parsed.value
    if parsed.conversation is not None:
        conversation = parsed.conversation
        field = conversation.field
        text: bytes | memoryview = memoryview(conversation.text)[
            conversation.head : len(conversation.text) - conversation.tail
        ]
    elif parsed.messages_text is not None:
        field, text = "messages", parsed.messages_text
    else:
        return None
    items = value[field]
    written, start = written_around(value, field)
    end = start + len(text) - 1
    if (
        len(raw) != len(written) - 1 + len(text)
        or not raw.startswith(memoryview(written)[:start])
        or not raw.startswith(text, start)
        or not raw.endswith(memoryview(written)[start + 1 :])
    ):
        return UNWRITTEN
    return BodyPrefix(raw, start, end, field, items.copy(), value.copy(), misses)


#: The :class:`BodyPrefix` of a body that is not orjson's writing of its values, or of
#: the :data:`MAX_MISSES`-th body in a row that did not extend its previous one (the
#: rollout's next bodies are parsed whole, and not tried).
UNWRITTEN = BodyPrefix(b"", 0, 0, "", [], {})
#: Bodies in a row that may fail to extend their previous one before a rollout stops
#: trying (each costs a write of the body's other values to find its list): an agent
#: that rewrites its history every turn before its last item never extends its previous
#: body; one that rewrote its history once (a compaction) does again.
MAX_MISSES = 2
_COMMA = ord(",")
_CLOSE = ord("]")
#: The bytes an item's text follows in a compact list: the list's ``[`` or a ``,``.
_ITEM_BEFORE = frozenset(b"[,")
#: The key of the list's rest when what follows a repeated history is parsed as an
#: object (:func:`_tail_changed`): one no agent can know, so that no body repeats it.
_TAIL_KEY = "\x00" + secrets.token_hex(16)
_TAIL_OPEN = orjson.dumps({_TAIL_KEY: 0})[:-2] + b"["

__all__ = ["MAX_MISSES", "UNWRITTEN", "BodyPrefix", "loads_extending"]
