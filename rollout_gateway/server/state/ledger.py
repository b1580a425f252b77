"""A rollout record's one owner: every change of its status and counters, and its write.

The turn path and the control plane never set a record's status or counters
themselves: they tell :class:`RolloutLedger` what happened, and it changes the record
and writes the change to the store before returning. The transitions:

* :meth:`~RolloutLedger.count_turn`: a turn was recorded and answered (its step, the
  counters and the answer a retry replays, written at once); the rollout completes at
  its turn limit;
* :meth:`~RolloutLedger.record_overflow`: the engine refused the turn's prompt as longer
  than its context (its step recorded without a sample): the rollout is over, truncated;
* :meth:`~RolloutLedger.note_failure`: an engine call failed (kept in ``failed_turns``);
* :meth:`~RolloutLedger.refuse`: a turn was refused at a limit (the trajectory reports
  the first limit that refused one);
* :meth:`~RolloutLedger.abandon_last`: the last answer reached nobody (the agent moved on
  without it): it is not a turn the agent saw;
* :meth:`~RolloutLedger.cancel`: the env cancelled the rollout.

A write that fails leaves the record marked stale (reloaded from the store before its
next use, see :mod:`.stored`) and raises the store's error. Reading a stored row back
into a record is :func:`.rows.apply_row`'s, under the turn's claim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollout_gateway.protocol import FailedTurn, TruncationReason
from rollout_gateway.server.state.registry import RolloutRecord
from rollout_gateway.server.state.rows import counters_of
from rollout_gateway.server.state.store import RolloutStore, StoreError, TurnAnswer, TurnCommit

#: Failed engine calls a rollout keeps (the most recent).
MAX_FAILED_TURNS = 100


@dataclass(slots=True)
class TurnUse:
    """What one recorded turn used of its rollout's budgets."""

    #: Bytes of the messages the turn stores (its new messages, its ``stop``).
    message_bytes: int
    #: The sample's completion tokens.
    completion_tokens: int
    #: (prompt tokens, completion tokens) as verifiers v1 counts them, for a rollout with
    #: v1 token caps (``None``: it has none).
    v1_tokens: tuple[int, int] | None = None


class RolloutLedger:
    """The transitions of the gateway's rollout records, each written to ``store``.

    Args:
        store: where the changes go.
        owner: this gateway's id (a turn's commit ends the claim it took under it).
        wall_clock: Unix time (stamped on the stored counters).
    """

    def __init__(self, store: RolloutStore, *, owner: str, wall_clock: Callable[[], float]):
        self.store = store
        self.owner = owner
        self.wall_clock = wall_clock

    async def count_turn(
        self,
        record: RolloutRecord,
        use: TurnUse,
        answer: TurnAnswer | None,
        *,
        delivered: bool | None = None,
    ) -> None:
        """The turn the recorder just recorded was answered: count it against the
        rollout's budgets (completing the rollout at its turn limit) and write its step,
        the counters and ``answer`` (what a retry replays) at once, ending the turn's
        claim (``delivered``: see :meth:`~.store.coordinator.TurnCoordinator.release`)."""
        record.message_bytes += use.message_bytes
        record.completion_tokens += use.completion_tokens
        record.num_turns += 1
        if record.token_budget is not None and use.v1_tokens is not None:
            record.token_budget.add_turn(*use.v1_tokens)
        if record.at_max_turns and record.status == "active":
            record.status = "completed"
        if not record.live:
            return  # unregistered while the turn ran: nothing to keep
        commit = self._commit_of(record, answer, delivered)
        try:
            record.revision = await self.store.commit_turn(record.rollout_id, commit)
        except StoreError:
            _stale(record)
            raise
        if answer is not None:
            record.answer_key = answer.key

    async def record_overflow(self, record: RolloutRecord) -> None:
        """The engine refused the turn's prompt as longer than its context; the recorder
        holds its step (the prompt, no sample). The rollout is over: recorded truncated
        (``context_length_exceeded``), later turns refused."""
        record.num_turns += 1  # a recorded step: num_turns stays the trajectory's length
        record.truncation_reason = "context_length_exceeded"
        if record.status == "active":
            record.status = "completed"
        if not record.live:
            return
        try:
            record.revision = await self.store.commit_turn(
                record.rollout_id, self._commit_of(record, None, None)
            )
        except StoreError:
            _stale(record)
            raise

    async def note_failure(self, record: RolloutRecord, failed: FailedTurn) -> None:
        """An engine call of the rollout failed (no sample, no step): kept among its
        ``failed_turns`` (the most recent :data:`MAX_FAILED_TURNS`)."""
        record.failed_turns.append(dict(failed))
        del record.failed_turns[:-MAX_FAILED_TURNS]
        await self._save(record)

    async def refuse(self, record: RolloutRecord, reason: TruncationReason | None) -> None:
        """A turn of the rollout was refused (``reason``: the limit that refused it;
        ``None``: cancelled or completed). The first limit that refused a turn is the
        trajectory's ``truncation_reason``."""
        if reason is None or record.truncation_reason is not None:
            return
        record.truncation_reason = reason
        await self._save(record)

    async def abandon_last(self, record: RolloutRecord) -> None:
        """The rollout's last answer reached nobody (its agent moved on without it): the
        step stays in the trajectory, marked abandoned, and no longer counts as a turn
        (a rollout completed by it takes turns again, unless a limit truncated it)."""
        record.recorder.abandon_last()
        record.num_turns -= 1
        if record.status == "completed" and record.truncation_reason is None:
            record.status = "active"
        await self._save(record)

    async def cancel(self, record: RolloutRecord) -> None:
        """The env cancelled the rollout: later turns are refused (in memory now, in the
        store for good)."""
        record.status = "cancelled"
        try:
            record.revision = await self.store.cancel_rollout(
                record.rollout_id, counters_of(record, self.wall_clock())
            )
        except StoreError:
            _stale(record)
            raise

    async def _save(self, record: RolloutRecord) -> None:
        """Write the counters (a change without a step)."""
        if not record.live:
            return  # unregistered meanwhile: nothing to keep
        try:
            record.revision = await self.store.save_rollout(
                record.rollout_id, counters_of(record, self.wall_clock())
            )
        except StoreError:
            _stale(record)
            raise

    def _commit_of(
        self, record: RolloutRecord, answer: TurnAnswer | None, delivered: bool | None
    ) -> TurnCommit:
        """The recorder's last step, the counters and the answer, as one write that ends
        the turn's claim."""
        recorder = record.recorder
        counters = counters_of(record, self.wall_clock())
        return TurnCommit(
            recorder.num_steps - 1, recorder.last_step, counters, answer, self.owner, delivered
        )


def _stale(record: RolloutRecord) -> None:
    # The store may not hold what this copy holds: reload before the next use.
    record.revision = -1
    record.loaded = False


__all__ = ["MAX_FAILED_TURNS", "RolloutLedger", "TurnUse"]
