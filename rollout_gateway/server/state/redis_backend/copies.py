"""What one gateway holds of each rollout, so that a claim reads what changed along.

With gateways taking turns of one rollout round robin, the gateway claiming a turn is
usually behind: another gateway recorded the last turn. It would then read the rollout's
fields and the new steps, two more round trips after the claim. :class:`HeldCopies`
remembers, per rollout, the revision and the step count this gateway last read or wrote;
the claim sends them and Redis answers, in the same round trip, what a copy that far
behind reads next (:data:`~.scripts.CLAIM`). The reads that follow the claim take it from
here (once) instead of asking Redis.

What a copy holds is only a hint: a copy that holds less than the hint says (dropped from
the gateway's cache, reloaded) asks for other steps, which are then read from Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

#: Rollouts remembered (the least recently used are forgotten: their next claim reads the
#: rollout in full, as a copy never seen).
MAX_REMEMBERED = 65_536


class HeldCopies:
    """Per rollout: the revision and step count this gateway's copy holds (a hint), and
    what the last claim read along for it."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self.max_remembered = max_remembered
        self._held: OrderedDict[str, tuple[int, int]] = OrderedDict()
        #: rollout -> (its fields as read, or None once taken; new steps; their start).
        self._along: dict[str, tuple[list[Any] | None, list[bytes], int]] = {}

    def held(self, rollout_id: str) -> tuple[str, str]:
        """(revision, steps) as the claim script compares them ("-1": nothing held)."""
        revision, steps = self._held.get(rollout_id, (-1, 0))
        return str(revision), str(steps)

    def wrote(self, rollout_id: str, revision: int, steps: int | None = None) -> None:
        """This gateway wrote the rollout, now at ``revision`` (with ``steps`` steps, when
        a step was written): what the claim read along is out of date."""
        self._along.pop(rollout_id, None)
        self.seen(rollout_id, revision, steps)

    def seen(self, rollout_id: str, revision: int, steps: int | None = None) -> None:
        """The copy now reflects ``revision`` (and holds ``steps`` steps, when given)."""
        _, held_steps = self._held.pop(rollout_id, (-1, 0))
        self._held[rollout_id] = (revision, held_steps if steps is None else steps)
        while len(self._held) > self.max_remembered:
            self._held.popitem(last=False)

    def loaded(self, rollout_id: str, start: int, count: int) -> None:
        """The copy read ``count`` steps from ``start``."""
        revision, held_steps = self._held.get(rollout_id, (-1, 0))
        if start <= held_steps:
            self.seen(rollout_id, revision, start + count)

    def read_along(
        self, rollout_id: str, fields: list[Any], steps: list[bytes], start: int
    ) -> None:
        """What the claim read along: the rollout's fields and its steps from ``start``."""
        self._along[rollout_id] = (fields, steps, start)

    def take_row(self, rollout_id: str) -> list[Any] | None:
        """The fields the claim read along (once), or ``None``."""
        along = self._along.get(rollout_id)
        if along is None or along[0] is None:
            return None
        self._along[rollout_id] = (None, along[1], along[2])
        return along[0]

    def take_steps(self, rollout_id: str, start: int) -> list[bytes] | None:
        """The steps the claim read along when they start at ``start`` (once), or ``None``."""
        along = self._along.pop(rollout_id, None)
        if along is None or along[2] != start:
            return None
        return along[1]

    def settled(self, rollout_id: str) -> None:
        """The claim ended: what it read along and nobody took is dropped."""
        self._along.pop(rollout_id, None)

    def forget(self, rollout_id: str) -> None:
        """The rollout is gone."""
        self._held.pop(rollout_id, None)
        self._along.pop(rollout_id, None)


__all__ = ["MAX_REMEMBERED", "HeldCopies"]
