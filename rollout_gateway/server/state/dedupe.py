"""Retries never become turns: match a request to a turn already running or answered.

An agent's SDK retries a request whose answer it did not get (read timeout, connection
reset): the OpenAI SDK resends the *same body* with ``x-stainless-retry-count: n``; other
clients send an ``Idempotency-Key``. Without care, the gateway records the original and
the retry as two turns (the first one nobody received) and the retry waits behind the
unfinished original. The :class:`TurnTracker` of a rollout remembers the turns queued or
running and the last answered one; a request matching one of them (same
``Idempotency-Key``, or an identical body) waits for that turn's answer instead of
starting a new turn. A turn whose answer reached nobody is *abandoned* (recorded, but
not as a step the agent saw) once the agent moves on.

The tracker holds this process's turns. A retry whose original was answered before a
restart, or by another gateway, is matched against the stored answer instead
(:func:`~rollout_gateway.server.state.store.answer_matches`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway.server.recording.digests import keyed_fingerprint


def body_fingerprint(raw: bytes, seed: int) -> bytes:
    """A digest of a request body (an SDK retry resends the same bytes), keyed with
    ``seed`` (the store's secret: a retry after a restart, or sent to another gateway,
    matches its original)."""
    return keyed_fingerprint(raw, seed)


@dataclass(eq=False)
class Turn:
    """One turn: its identity, its task and whether its answer reached the agent."""

    fingerprint: bytes
    idempotency_key: str | None
    #: The request that started it is marked as a retry (``x-stainless-retry-count``).
    is_retry: bool = False
    task: asyncio.Task[Any] = field(default=None)  # type: ignore[arg-type]  # set at start
    #: Requests (the original and its retries) waiting for the answer, still connected.
    waiters: int = 0
    finished_at: float | None = None
    #: Set once an answer was handed to a client still connected.
    delivered: bool = False
    #: Whether the turn was recorded as a trajectory step (false when it failed).
    recorded: bool = False
    #: The turn's SSE events when it was asked as a stream (``streaming.EventLog``):
    #: every request waiting on the turn follows it from the start.
    events: Any = None


@dataclass
class TurnTracker:
    """The turns of one rollout that a retry may match.

    Args:
        window_s: how long after its answer a turn still matches an identical body.
        clock: monotonic clock.
    """

    window_s: float
    clock: Callable[[], float]
    pending: list[Turn] = field(default_factory=list)
    last: Turn | None = None

    def match(
        self, fingerprint: bytes, idempotency_key: str | None, *, is_retry: bool = False
    ) -> Turn | None:
        """The turn a request with this body / key repeats, if any.

        * same ``Idempotency-Key`` as a queued, running or the last answered turn;
        * else the same body as a queued or running turn;
        * else the same body as the last answered turn, within ``window_s`` of its
          answer, if the client marks the request as a retry (``is_retry``: the OpenAI
          SDK's ``x-stainless-retry-count`` > 0) or the answer reached nobody. An agent
          that deliberately sends the same conversation again, without retry marks,
          after it got the answer, gets a new turn.
        """
        candidates = [*self.pending]
        if self.last is not None:
            candidates.append(self.last)
        for turn in candidates:
            if idempotency_key is not None and turn.idempotency_key is not None:
                if turn.idempotency_key == idempotency_key:
                    return turn
                continue  # both carry keys and they differ: a new request
            if turn.fingerprint != fingerprint:
                continue
            if turn.finished_at is None:
                return turn
            recent = self.clock() - turn.finished_at <= self.window_s
            if recent and (is_retry or not turn.delivered):
                return turn
        return None

    def start(self, turn: Turn) -> None:
        """A new turn is queued."""
        self.pending.append(turn)

    def finish(self, turn: Turn) -> None:
        """``turn`` ended (answered or failed): it becomes the last one."""
        turn.finished_at = self.clock()
        if turn in self.pending:
            self.pending.remove(turn)
        if turn.recorded:
            self.last = turn


__all__ = ["Turn", "TurnTracker", "body_fingerprint"]
