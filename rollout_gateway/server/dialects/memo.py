"""What a rollout's previous request translated to: only the new part of a request is translated.

Every request repeats the conversation so far, and translating a message costs Python
work, where the chat path's own checks over the history are single passes in C (a digest
of the messages' text, ``==`` of lists). So a dialect keeps what the previous request of
the rollout translated to (its native messages, and the chat messages each produced) and
takes the chat messages of the leading native messages that are ``==`` the previous
request's (one C comparison of the lists, the usual case) as they are: a turn translates
what the agent added since. The memo is a cache checked by equality, never trusted: a
request that rewrote its history, or a memo of another request, only costs a full
translation. Its holder (the rollout) keeps the previous request's parsed messages alive
until the next one, about what the chat path's history keeps. A body the intake parsed
from the previous body's bytes (:mod:`~rollout_gateway.server.http.body_prefix`) holds
the previous request's items themselves: the comparison then meets the same objects
(an identity each), and no conversation text is written for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_gateway.server.http.jsonio import ConversationText


@dataclass(slots=True)
class ConversationMemo:
    """A request's conversation and its translation.

    ``ends[i]``: how many chat messages the translation holds after native item ``i``
    (``None`` when item ``i`` leaves a unit open, e.g. inside a run of Responses
    assistant items, whose message is written at the run's end). ``dropped[i]``: the
    content types item ``i``'s translation dropped.
    """

    head: Any
    native: list[Any]
    messages: list[dict[str, Any]]
    ends: list[int | None]
    dropped: dict[int, list[str]] = field(default_factory=dict)
    #: Tools the conversation's items declare, with their item's index (Responses'
    #: ``additional_tools`` / ``tool_search_output`` items).
    declared: list[tuple[int, Any]] = field(default_factory=list)
    #: ``native`` as the request's depth check wrote it (``None``: not written).
    text: ConversationText | None = None
    #: ``orjson.dumps(messages)`` (``None``: not written).
    messages_text: bytes | None = None

    def extended_by(self, text: ConversationText | None) -> bool:
        """Whether ``text`` (a request's conversation JSON) starts with every item of
        this memo's request (:func:`extends`; ``False`` when either text is unknown)."""
        return text is not None and self.text is not None and extends(text, self.text)

    def reusable(
        self,
        head: Any,
        native: list[Any],
        text: ConversationText | None = None,
        extended: bool | None = None,
    ) -> int:
        """How many leading items of ``native`` (under ``head``; ``text``: its JSON) can
        take this memo's translation (0: none). ``extended``: :meth:`extended_by`'s answer
        for ``text``, when the caller has it already."""
        if head != self.head:
            return 0
        if extended is None:
            extended = self.extended_by(text)
        if extended:
            shared = len(self.native)  # one memcmp, not a comparison of every object
        else:
            shared = shared_prefix(native, self.native)
        while shared and self.ends[shared - 1] is None:
            shared -= 1
        return shared


@dataclass(slots=True)
class ToolsMemo:
    """A request's tool declarations and what the engine got of them."""

    native: Any
    tools: list[dict[str, Any]]
    dropped: list[str]
    namespaces: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class HeadMemo:
    """What a request's fields beside its conversation (:func:`rest_of`) made: the chat
    fields but ``messages`` and ``tools``, the turn's facts but what the conversation and
    the tools dropped, and the renderers' context. Taken as it is for a request whose
    fields beside its conversation are ``==`` (an agent sends the same ones every turn:
    one C comparison instead of a check of each field)."""

    rest: dict[str, Any]
    stream: bool
    chat: dict[str, Any]
    facts: dict[str, Any]
    context: Any = None


def rest_of(body: dict[str, Any], conversation: tuple[str, str]) -> dict[str, Any]:
    """``body`` without its ``conversation`` fields (the conversation memo compares those
    itself: a second comparison of a 32k system prompt is a pass over 32 kB)."""
    rest = body.copy()
    rest.pop(conversation[0], None)
    rest.pop(conversation[1], None)
    return rest


@dataclass(slots=True)
class ParseMemo:
    """What one request of a rollout translated to (:attr:`~.base.ParsedRequest.memo`;
    passed to the dialect's ``parse`` of the rollout's next request)."""

    conversation: ConversationMemo | None = None
    tools: ToolsMemo | None = None
    head: HeadMemo | None = None


def extends(text: ConversationText, previous: ConversationText) -> bool:
    """Whether the list ``text`` was written from starts with every item of the list
    ``previous`` was written from (its text, but the closing bracket, then ``,`` or
    ``]``). Exact: equal JSON text is equal values (orjson writes one text per value; a
    difference in key order only fails the check, and the caller compares the objects)."""
    if text.field != previous.field or text.head != previous.head:
        return False
    end = len(previous.text) - previous.tail - 1  # the previous list's closing bracket
    current = text.text
    if len(current) - text.tail <= end or current[end] not in _AFTER_ITEM:
        return False
    if end < _COPY_BELOW:  # a short text: a copy costs less than a memoryview
        return current.startswith(previous.text[:end])
    return current.startswith(memoryview(previous.text)[:end])  # no copy of a long text


def extended_text(messages: list[dict[str, Any]], memo: ConversationMemo | None) -> bytes:
    """``orjson.dumps(messages)``, where ``messages`` starts with every message of
    ``memo`` (the very objects: the memo's translation taken whole, never changed after
    the parse): its text, then only the new messages written (orjson writes a list as its
    items' texts between ``[``, ``,`` and ``]``, each item's alone)."""
    if memo is None or memo.messages_text is None or not memo.messages:
        return orjson.dumps(messages)
    size = len(memo.messages)
    if len(messages) == size:
        return memo.messages_text
    previous, added = memo.messages_text, orjson.dumps(messages[size:])
    if len(previous) < _COPY_BELOW:  # a short text: copies cost less than two memoryviews
        return b",".join((previous[:-1], added[1:]))
    # One copy of each part, joined by the comma (a slice and concatenations: three).
    return b",".join((memoryview(previous)[:-1], memoryview(added)[1:]))


#: What follows the last item of a list that the next one extends: ``,`` or ``]``.
_AFTER_ITEM = frozenset(b",]")
#: Below this many bytes :func:`extends` compares a copy of the previous text's prefix
#: and :func:`extended_text` joins copies (a memoryview's making and buffer protocol
#: cost more than copying a short text).
_COPY_BELOW = 8192


def shared_prefix(items: Sequence[Any], previous: Sequence[Any]) -> int:
    """How many leading ``items`` equal ``previous``'s. One C comparison when all the
    previous items are repeated, or all but the last (agents move their cache markers to
    the newest message); else a scan for the first difference."""
    size = min(len(items), len(previous))
    if size and items[size - 1] == previous[size - 1] and items[:size] == previous[:size]:
        return size
    if size > 1 and items[: size - 1] == previous[: size - 1]:
        return size - 1
    for index in range(size):
        if items[index] != previous[index]:
            return index
    return size


__all__ = [
    "ConversationMemo",
    "HeadMemo",
    "ParseMemo",
    "ToolsMemo",
    "extended_text",
    "extends",
    "rest_of",
    "shared_prefix",
]
