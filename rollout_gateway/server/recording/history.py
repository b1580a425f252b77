"""A rollout's chat history, and whether a turn's request extends it.

Every turn's request repeats the conversation so far. The gateway records each message
once, so it must know how many leading messages of a request the recorded history (the
last turn's prompt plus its answer) already holds. :class:`MessageHistory` answers that
with the cheapest check that is exact:

1. A digest of the request's messages as JSON text. An agent repeats its earlier messages
   verbatim, so the text of this request begins with the text of the last one; one
   XXH3 pass over it (:mod:`.digests`) proves those messages equal without reading the
   stored history. Comparing the stored dicts instead touched every message of a history
   long out of the CPU's caches (64 rollouts in flight): it cost 4-8x what it did in a
   warm loop, and more than the digest and the JSON text together.
2. ``==`` against the history in the form the agent last sent it (in C).
3. Entry by entry: an SDK that sends an answer back in another form (``content: null``
   dropped, text parts for a string) still extends the history (:func:`same_message`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_gateway.server.recording.digests import ArrayText, shared_elements

#: The text of a request's messages, for the next request's check.
SentText = ArrayText


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) if isinstance(part, Mapping) else str(part)
            for part in content
        )
    return json.dumps(content, sort_keys=True)


def message_key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two chat messages "the same" when checking that history is extended.

    SDKs re-serialise assistant messages with cosmetic differences (``content: null`` vs
    ``""``, extra ``refusal: null``, text parts vs string); those must not count as a
    rewritten history.
    """
    calls = tuple(
        (
            str(c.get("id", "")),
            str((c.get("function") or {}).get("name", "")),
            _canonical_arguments((c.get("function") or {}).get("arguments", "")),
        )
        for c in (message.get("tool_calls") or ())
        if isinstance(c, Mapping)
    )
    return (
        message.get("role"),
        _text(message.get("content")),
        calls,
        message.get("tool_call_id") or "",
        message.get("name") or "",
    )


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """``message_key(a) == message_key(b)``, without the JSON work where it cannot matter.

    Tool-call arguments that are the very same text need no canonical form: in the usual
    echo the agent repeats them verbatim, and canonicalising both sides was most of the
    cost of checking a turn's history.
    """
    if (
        a.get("role") != b.get("role")
        or (a.get("tool_call_id") or "") != (b.get("tool_call_id") or "")
        or (a.get("name") or "") != (b.get("name") or "")
        or _text(a.get("content")) != _text(b.get("content"))
    ):
        return False
    calls_a = [c for c in (a.get("tool_calls") or ()) if isinstance(c, Mapping)]
    calls_b = [c for c in (b.get("tool_calls") or ()) if isinstance(c, Mapping)]
    if len(calls_a) != len(calls_b):
        return False
    for call_a, call_b in zip(calls_a, calls_b, strict=True):
        function_a, function_b = call_a.get("function") or {}, call_b.get("function") or {}
        if str(call_a.get("id", "")) != str(call_b.get("id", "")) or str(
            function_a.get("name", "")
        ) != str(function_b.get("name", "")):
            return False
        args_a, args_b = function_a.get("arguments", ""), function_b.get("arguments", "")
        if isinstance(args_a, str) and args_a == args_b:
            continue
        if _canonical_arguments(args_a) != _canonical_arguments(args_b):
            return False
    return True


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


#: Message fields the trajectory keeps; everything else an agent sends (vendor extras,
#: cache hints, ids...) is dropped when the message is stored, so it costs no memory.
RECORDED_MESSAGE_FIELDS = (
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
    # Provider state a dialect's message carries beside the chat shape (Anthropic
    # thinking blocks, Responses reasoning items): part of a message's identity in v1.
    "reasoning_details",
)


def recorded_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a chat message the trajectory keeps (see :data:`RECORDED_MESSAGE_FIELDS`)."""
    return {k: message[k] for k in RECORDED_MESSAGE_FIELDS if k in message}


# Not frozen: made every turn, and a frozen dataclass's constructor costs several
# times a plain one's (issue 33).
@dataclass(slots=True)
class HistoryMatch:
    """What a request's messages share with a rollout's recorded history."""

    #: Leading messages the history holds already (``None``: the request rewrites it).
    shared: int | None
    #: The request's messages as text, which the next request is checked against once
    #: this one is recorded (``None``: not JSON-serialisable, no text check next time).
    sent: SentText | None = None
    #: :meth:`new_messages`, once made.
    _new: list[dict[str, Any]] | None = field(default=None, init=False, repr=False, compare=False)

    def new_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The part the trajectory keeps (:func:`recorded_message`) of the messages the
        history does not hold yet: ``messages`` (the request this match was made for)
        after the shared ones, all of them when rewritten. Made once per request (the
        turn's limits count them, the recorder stores them)."""
        new = self._new
        if new is None:
            new = self._new = [recorded_message(m) for m in messages[self.shared or 0 :]]
        return new


#: What :meth:`MessageHistory.snapshot` saves.
HistorySnapshot = tuple[list[dict[str, Any]], list[dict[str, Any]], "SentText | None"]


class MessageHistory:
    """The last turn's prompt plus its answer, as recorded, and the state that checks the
    next request against it cheaply (see the module doc)."""

    def __init__(self) -> None:
        #: The last turn's prompt and answer messages, as recorded.
        self.messages: list[dict[str, Any]] = []
        #: ``messages`` as the agent last sent them (trimmed): what its next request
        #: repeats, so that a plain ``==`` matches most of its history.
        self._match_base: list[dict[str, Any]] = []
        #: Where the last entry-by-entry check started to need more than ``==``: the
        #: prefix before it is checked in one C comparison next time.
        self._echo_hint = 0
        #: The last recorded request's messages as text.
        self._sent: SentText | None = None

    def match(
        self, messages: Sequence[Mapping[str, Any]], text: bytes | memoryview | None = None
    ) -> HistoryMatch:
        """How many leading ``messages`` the history holds (``None``: rewritten).

        ``text`` is ``orjson.dumps(messages)`` when the caller has it already.
        """
        sent, known = self._text_check(messages, text)
        return HistoryMatch(self._shared(messages, known), sent)

    def advance(
        self,
        match: HistoryMatch,
        new_messages: list[dict[str, Any]],
        completion: list[dict[str, Any]],
    ) -> None:
        """The recorded turn's prompt (``match.shared`` messages of the history, then
        ``new_messages``) and its ``completion`` become the history."""
        shared = match.shared or 0
        self.messages = [*self.messages[:shared], *new_messages, *completion]
        self._match_base = [*self._match_base[:shared], *new_messages, *completion]
        self._sent = match.sent

    @property
    def sent(self) -> SentText | None:
        """The last recorded request's messages as text (what the next one is checked
        against; ``None``: none)."""
        return self._sent

    def resume(self, sent: SentText | None) -> None:
        """Check the next request against ``sent`` (the text state the gateway that
        recorded the last step had: a copy replayed up to that step). Ignored unless it
        describes at most the messages held (a stale hint is never trusted)."""
        if sent is not None and sent[2] <= len(self.messages):
            self._sent = sent

    def snapshot(self) -> HistorySnapshot:
        """What :meth:`restore` needs to undo the next :meth:`advance`."""
        return self.messages, list(self._match_base), self._sent

    def restore(self, snapshot: HistorySnapshot) -> None:
        """Undo the :meth:`advance` calls since ``snapshot``."""
        self.messages, self._match_base, self._sent = snapshot

    def _text_check(
        self, messages: Sequence[Mapping[str, Any]], text: bytes | memoryview | None
    ) -> tuple[SentText | None, int]:
        """The messages' text state, and how many leading messages are the last recorded
        request's very messages (their text matches its digest)."""
        if text is None:
            try:
                text = orjson.dumps(messages)
            except TypeError:  # not JSON (only a caller in Python can pass that)
                return None, 0
        known, digest, length = shared_elements(text, self._sent)
        return (digest, length, len(messages)), known

    def _shared(self, messages: Sequence[Mapping[str, Any]], known: int) -> int | None:
        shared = len(self.messages)
        if len(messages) < shared:
            return None
        base, recorded = self._match_base, self.messages
        start = min(known, shared)
        if not start:
            # C comparisons: the prefix that passed by ``==`` last time, then the rest.
            start = min(self._echo_hint, shared)
            if messages[:start] != base[:start]:
                start = 0
        if messages[start:shared] == base[start:]:
            return shared
        # Entry by entry from ``start`` (entries before the first that needs more than
        # ``==`` are compared again; that is accepted).
        first_slow = shared
        for i in range(start, shared):
            m, p = messages[i], base[i]
            if m == p:
                continue
            first_slow = min(first_slow, i)
            trimmed = recorded_message(m)
            if trimmed == p:
                continue
            if not same_message(m, recorded[i]):
                return None
            base[i] = trimmed  # an SDK's re-serialised echo: match it by == next time
        self._echo_hint = first_slow
        return shared


__all__ = [
    "RECORDED_MESSAGE_FIELDS",
    "HistoryMatch",
    "HistorySnapshot",
    "MessageHistory",
    "SentText",
    "message_key",
    "recorded_message",
    "same_message",
]
