"""The memory backend: the gateway's state in this process only (the default).

Nothing survives the process: a restarted gateway has lost every rollout. It keeps
references, not copies (a step is the recorder's own object, an answer the bytes the agent
got), so a turn costs what it cost before the store seam: a few dictionary operations.

The tests share one between several gateways of one process, as gateways share Redis
(``tests/support/shared_memory.py``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import orjson

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import RecordedStep, StepDelta
from rollout_gateway.server.state.store import (
    PolicyState,
    Registration,
    RolloutCounters,
    RolloutExistsError,
    RolloutRow,
    RolloutStore,
    StoreContents,
    StoredAnswer,
    TurnAnswer,
    TurnCommit,
    TurnConflictError,
    UnknownRolloutError,
)


@dataclass(slots=True)
class _Rollout:
    registration: Registration
    counters: RolloutCounters
    revision: int = 0
    cancelled: bool = False
    steps: list[RecordedStep] = field(default_factory=list)
    answer: TurnAnswer | None = None


class MemoryStore(RolloutStore):
    """The gateway's state in this process's memory."""

    name = "memory"
    durable = False

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._rollouts: dict[str, _Rollout] = {}
        self._by_key: dict[str, str] = {}
        self._exits: dict[str, ExitReport] = {}
        self._policy = PolicyState()
        #: The last exit report number given (by whoever numbers them).
        self._exit_seq = 0

    @property
    def secret(self) -> bytes:
        """Made with the store (a restart makes a new one: nothing else survives it)."""
        return self._secret

    async def open(self) -> StoreContents:
        """What this store holds now (nothing, unless other gateways share it)."""
        exits = sorted(self._exits.values(), key=lambda r: r["seq"])
        return StoreContents(
            rollouts=[self._row(r) for r in self._rollouts.values()],
            policy=PolicyState(self._policy.version, self._policy.updated_at),
            exits=[dict(r) for r in exits],  # type: ignore[misc]
            exit_cursor=max(self._exit_seq, exits[-1]["seq"] if exits else 0),
        )

    async def close(self) -> None:
        """Nothing to release."""

    def _get(self, rollout_id: str) -> _Rollout:
        rollout = self._rollouts.get(rollout_id)
        if rollout is None:
            raise UnknownRolloutError(rollout_id)
        return rollout

    @staticmethod
    def _row(rollout: _Rollout) -> RolloutRow:
        answer = rollout.answer
        return RolloutRow(
            registration=dict(rollout.registration),  # type: ignore[arg-type]
            counters=dict(rollout.counters),  # type: ignore[arg-type]
            revision=rollout.revision,
            steps=len(rollout.steps),
            answer_key=answer.key if answer is not None else None,
            cancelled=rollout.cancelled,
        )

    # -- rollouts ------------------------------------------------------------------------

    async def create_rollout(self, row: RolloutRow) -> None:
        """Hold a new rollout."""
        rollout_id = row.registration["rollout_id"]
        if rollout_id in self._rollouts:
            raise RolloutExistsError(rollout_id)
        self._rollouts[rollout_id] = _Rollout(row.registration, row.counters)
        digest = row.registration.get("key_digest")
        if digest is not None:
            self._by_key[digest] = rollout_id

    async def load_rollout(self, rollout_id: str) -> RolloutRow | None:
        """The held rollout (a copy)."""
        rollout = self._rollouts.get(rollout_id)
        return self._row(rollout) if rollout is not None else None

    async def rollout_for_key(self, key_digest: str) -> str | None:
        """The rollout whose key has this digest."""
        return self._by_key.get(key_digest)

    async def save_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Replace the counters."""
        rollout = self._get(rollout_id)
        rollout.counters = counters
        rollout.revision += 1
        return rollout.revision

    async def cancel_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Cancel for good and replace the counters."""
        rollout = self._get(rollout_id)
        rollout.cancelled = True
        rollout.counters = counters
        rollout.revision += 1
        return rollout.revision

    async def delete_rollout(self, rollout_id: str) -> bool:
        """Drop the rollout, its steps, answer and exit report."""
        rollout = self._rollouts.pop(rollout_id, None)
        self._exits.pop(rollout_id, None)
        if rollout is None:
            return False
        digest = rollout.registration.get("key_digest")
        if digest is not None and self._by_key.get(digest) == rollout_id:
            del self._by_key[digest]
        return True

    # -- turns ---------------------------------------------------------------------------

    async def commit_turn(self, rollout_id: str, commit: TurnCommit) -> int:
        """Append the step (by reference), replace the counters and the answer."""
        rollout = self._get(rollout_id)
        if commit.index != len(rollout.steps):
            raise TurnConflictError(
                f"rollout {rollout_id}: step {commit.index} committed on {len(rollout.steps)}"
            )
        rollout.steps.append(commit.step)
        rollout.counters = commit.counters
        answer = commit.answer
        if answer is not None:  # the agent's bytes only (not a second copy of them)
            if answer.without_prompt_ids is not None:
                answer = TurnAnswer(answer.key, answer.body)
            rollout.answer = answer
        rollout.revision += 1
        return rollout.revision

    async def load_steps(self, rollout_id: str, start: int = 0) -> list[StepDelta]:
        """The held steps from ``start`` (their ids copied out of the branches)."""
        return [step.delta() for step in self._get(rollout_id).steps[start:]]

    async def load_answer(self, rollout_id: str) -> StoredAnswer | None:
        """The last answer, as the agent got it."""
        rollout = self._rollouts.get(rollout_id)
        answer = rollout.answer if rollout is not None else None
        if answer is None:
            return None
        body = answer.body
        return StoredAnswer(body if isinstance(body, bytes) else orjson.dumps(body))

    # -- exit reports and the policy version -----------------------------------------------

    async def save_exit(self, report: ExitReport) -> None:
        """Keep the report (if its rollout is held, or none are: a board of its own)."""
        self._exits[report["rollout_id"]] = dict(report)  # type: ignore[assignment]

    async def forget_exit(self, rollout_id: str) -> None:
        """Drop the rollout's report."""
        self._exits.pop(rollout_id, None)

    async def announce_policy(self, version: int, at: float) -> PolicyState:
        """Forward only."""
        current = self._policy
        if current.version is None or version > current.version:
            self._policy = PolicyState(version, at)
        return PolicyState(self._policy.version, self._policy.updated_at)

    async def load_policy(self) -> PolicyState:
        """The version in effect."""
        return PolicyState(self._policy.version, self._policy.updated_at)


__all__ = ["MemoryStore"]
