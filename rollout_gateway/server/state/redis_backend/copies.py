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

Beside the last step, the commit stores what the recording gateway checks the next turn
against (the step's :class:`~rollout_gateway.server.recording.steps.CheckState`, packed by
:func:`encode_check`); the claim reads it along with the steps, and the copy replayed up
to that step checks the next request as cheaply as the recording gateway would.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any

from rollout_gateway.server.recording.digests import ArrayText
from rollout_gateway.server.recording.steps import CheckState, StepDelta
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.store import StoreCorruptError

#: version, step index, then per digest: whether there is one, the digest, the text's
#: length, the element count.
_CHECK = struct.Struct("<BIB16sIIB16sII")
_CHECK_VERSION = 1
_NO_TEXT: tuple[bool, bytes, int, int] = (False, bytes(16), 0, 0)


def _packed_text(text: ArrayText | None) -> tuple[bool, bytes, int, int]:
    return _NO_TEXT if text is None else (True, *text)


def encode_check(index: int, check: CheckState | None) -> bytes:
    """Step ``index``'s check state, sealed (``b""``: none)."""
    if check is None or (check.messages is None and check.prompt_ids is None):
        return b""
    parts = (*_packed_text(check.messages), *_packed_text(check.prompt_ids))
    return codec.seal(_CHECK.pack(_CHECK_VERSION, index, *parts))


def decode_check(blob: bytes | None) -> tuple[int, CheckState] | None:
    """(step index, check state) of :func:`encode_check`'s bytes; ``None`` for none, or
    for bytes that fail their checks (a hint: the next check just costs more)."""
    if not blob:
        return None
    try:
        payload = codec.unseal(blob, "check state")
        version, index, has_m, dm, lm, cm, has_p, dp, lp, cp = _CHECK.unpack(payload)
    except (StoreCorruptError, struct.error):
        return None
    if version != _CHECK_VERSION:
        return None
    messages = (dm, lm, cm) if has_m else None
    return index, CheckState(messages, (dp, lp, cp) if has_p else None)


def attach_check(steps: list[StepDelta], start: int, blob: bytes | None) -> None:
    """Hand the stored check state to the last of ``steps`` (from index ``start``) when
    it is that step's."""
    check = decode_check(blob) if steps else None
    if check is not None and check[0] == start + len(steps) - 1:
        steps[-1].check = check[1]


#: Rollouts remembered (the least recently used are forgotten: their next claim reads the
#: rollout in full, as a copy never seen).
MAX_REMEMBERED = 65_536


class HeldCopies:
    """Per rollout: the revision and step count this gateway's copy holds (a hint), and
    what the last claim read along for it."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self.max_remembered = max_remembered
        self._held: OrderedDict[str, tuple[int, int]] = OrderedDict()
        #: rollout -> (its fields as read, or None once taken; new steps; their start;
        #: the last step's check state).
        self._along: dict[str, tuple[list[Any] | None, list[bytes], int, bytes | None]] = {}

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
        self,
        rollout_id: str,
        fields: list[Any],
        steps: list[bytes],
        start: int,
        check: bytes | None = None,
    ) -> None:
        """What the claim read along: the rollout's fields, its steps from ``start`` and
        the last step's check state."""
        self._along[rollout_id] = (fields, steps, start, check)

    def take_row(self, rollout_id: str) -> list[Any] | None:
        """The fields the claim read along (once), or ``None``."""
        along = self._along.get(rollout_id)
        if along is None or along[0] is None:
            return None
        self._along[rollout_id] = (None, *along[1:])
        return along[0]

    def take_steps(self, rollout_id: str, start: int) -> tuple[list[bytes], bytes | None] | None:
        """The steps the claim read along when they start at ``start``, and the last
        step's check state (once), or ``None``."""
        along = self._along.pop(rollout_id, None)
        if along is None or along[2] != start:
            return None
        return along[1], along[3]

    def settled(self, rollout_id: str) -> None:
        """The claim ended: what it read along and nobody took is dropped."""
        self._along.pop(rollout_id, None)

    def forget(self, rollout_id: str) -> None:
        """The rollout is gone."""
        self._held.pop(rollout_id, None)
        self._along.pop(rollout_id, None)


__all__ = ["MAX_REMEMBERED", "HeldCopies", "attach_check", "decode_check", "encode_check"]
