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
until the next one, about what the chat path's history keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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

    def reusable(self, head: Any, native: list[Any]) -> int:
        """How many leading items of ``native`` (under ``head``) can take this memo's
        translation (0: none)."""
        if head != self.head:
            return 0
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
class ParseMemo:
    """What one request of a rollout translated to (:attr:`~.base.ParsedRequest.memo`;
    passed to the dialect's ``parse`` of the rollout's next request)."""

    conversation: ConversationMemo | None = None
    tools: ToolsMemo | None = None


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


__all__ = ["ConversationMemo", "ParseMemo", "ToolsMemo", "shared_prefix"]
