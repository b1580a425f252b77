"""Rollouts a gateway is writing or reading right now: :class:`InFlight`.

On a shared store another gateway may remove a rollout at any moment and this gateway
hears of it by an event, or not at all while its events channel is down
(:meth:`~.store.StoreEvents.missed_events`). Two moments need care: a rollout being
registered here is held before the store has it (a check of what the store still holds
must pass it by), and a rollout being read from the store may be removed after the read
and before it returns (the removal heard meanwhile must win over the row read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class InFlight:
    """The rollouts being registered and read by one gateway (see the module doc)."""

    def __init__(self) -> None:
        #: Held here, their store write not done.
        self.registering: set[str] = set()
        self._reads: dict[str, int] = {}  # rollout -> reads under way
        self._removed: set[str] = set()  # of those, removed elsewhere meanwhile

    @contextlib.contextmanager
    def registration(self, rollout_id: str) -> Iterator[None]:
        """While ``rollout_id``'s registration is written to the store."""
        self.registering.add(rollout_id)
        try:
            yield
        finally:
            self.registering.discard(rollout_id)

    def read_started(self, rollout_id: str) -> None:
        """A read of ``rollout_id`` from the store began."""
        self._reads[rollout_id] = self._reads.get(rollout_id, 0) + 1

    def read_done(self, rollout_id: str) -> bool:
        """A read of ``rollout_id`` ended; whether it was removed elsewhere meanwhile (the
        row read must then not be held)."""
        left = self._reads.pop(rollout_id) - 1
        removed = rollout_id in self._removed
        if left:
            self._reads[rollout_id] = left
        else:
            self._removed.discard(rollout_id)
        return removed

    def removed(self, rollout_id: str) -> None:
        """Another gateway removed ``rollout_id``."""
        if rollout_id in self._reads:
            self._removed.add(rollout_id)


__all__ = ["InFlight"]
