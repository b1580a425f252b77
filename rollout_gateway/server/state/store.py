"""The persistence seam: everything the gateway must not lose goes through :class:`RolloutStore`.

The gateway works on its in-memory records (:mod:`.registry`: a rollout's counters, its
recorder, its local turn queue); the store is written through at a few points and read
back when the records are not current:

* **rollouts**: :meth:`~RolloutStore.create_rollout` at register (fails when the id is
  taken), :meth:`~RolloutStore.save_rollout` when the counters change without a step
  (cancel, a refused turn, a failed engine call, an abandoned answer),
  :meth:`~RolloutStore.delete_rollout` at unregister or expiry;
  :meth:`~RolloutStore.load_rollout` / :meth:`~RolloutStore.rollout_for_key` read them back;
* **turns**: :meth:`~RolloutStore.commit_turn` writes one turn atomically: its step (the
  compact delta, :class:`~rollout_gateway.server.recording.steps.StepDelta`), the
  rollout's counters and the answer a retry replays, conditional on the step's index, so
  a turn is never recorded twice nor half; :meth:`~RolloutStore.load_steps` and
  :meth:`~RolloutStore.load_answer` read them back;
* **exit reports** (:meth:`~RolloutStore.save_exit`, :meth:`~RolloutStore.forget_exit`)
  and the **policy version** (:meth:`~RolloutStore.announce_policy`,
  :meth:`~RolloutStore.load_policy`);
* the **secret** shared by every gateway on the store and by restarts
  (:attr:`~RolloutStore.secret`): request fingerprints are keyed with it, so that a
  retry after a restart, or on another gateway, matches its original.

Who runs a rollout's turn, who numbers exit reports and what other gateways changed is
coordination, not persistence: :mod:`.coordinator` (:class:`~.coordinator.TurnCoordinator`;
a gateway alone on its store needs no other gateway's word, several gateways on one Redis
do). The coordination of each store is chosen once, where the app is assembled
(:func:`~.backends.coordinator_for`).

Backends: :mod:`.memory` (this process only; the default), :mod:`.sqlite` (one
gateway, durable across restarts), and :mod:`.redis_backend` (several gateways). Every
backend passes the contract tests (``tests/server/state/test_store_contract.py``).

Every method may raise :class:`StoreUnavailableError` (the store cannot be reached or
written now: the request gets a 503 its client retries; nothing half-written is kept).
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import RecordedStep, StepDelta


class StoreError(Exception):
    """A state store failed."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached or written (unwritable directory, disk full, a lost
    connection). At start the gateway exits; mid-run the request is answered 503."""


class StoreVersionError(StoreError):
    """The stored state was written by another version of the gateway (another schema):
    it is refused, never misread."""


class StoreCorruptError(StoreError):
    """Stored state failed its checks (a damaged or truncated file, a record whose
    checksum does not match). Never served as a trajectory."""


class RolloutExistsError(StoreError):
    """A rollout with this id is stored already."""


class UnknownRolloutError(StoreError):
    """No rollout with this id is stored (unregistered, expired, never registered)."""


class TurnConflictError(StoreError):
    """A turn was committed on a step count that is not the stored one (another gateway
    committed first, or the turn is a duplicate): nothing was written."""


class Registration(TypedDict, total=False):
    """What register fixed for a rollout (written once). Optional fields may be added;
    readers ignore keys they do not know."""

    rollout_id: str
    model: str
    sampling_params: dict[str, Any]
    max_turns: int
    max_seq_len: int | None
    upstream: str
    #: SHA-256 of the rollout's key, hex (``None``: keys are off). The key itself is
    #: never stored.
    key_digest: str | None
    trajectory_id: str
    max_total_completion_tokens: int | None
    max_context_tokens: int | None
    max_message_bytes: int | None
    #: verifiers v1 token caps (``server/state/limits_v1.py``), by name.
    token_caps: dict[str, int] | None
    #: Wall time of the registration.
    registered_at: float


class RolloutCounters(TypedDict, total=False):
    """What a rollout's turns and the control plane change (rewritten on each change).
    Optional fields may be added; readers ignore keys they do not know."""

    status: str
    num_turns: int
    completion_tokens: int
    message_bytes: int
    truncation_reason: str | None
    #: verifiers v1 token use: new input, output, and the previous turn's total.
    input_tokens: int
    output_tokens: int
    previous_total: int
    #: Indexes of the steps abandoned (their answer reached nobody).
    abandoned: list[int]
    #: Failed engine calls, the most recent (``protocol.FailedTurn``).
    failed_turns: list[dict[str, Any]]
    #: Wall time of the change (idle expiry counts from it after a restart).
    updated_at: float


@dataclass(slots=True)
class AnswerKey:
    """What identifies the last answered turn of a rollout, for a retry to match."""

    #: Digest of the request body, keyed with :attr:`RolloutStore.secret`.
    fingerprint: bytes
    idempotency_key: str | None
    #: Wall time of the answer.
    finished_at: float
    #: Index of the step the answer is the turn of.
    step: int
    #: Whether the answer reached its agent, as far as the gateways know. A store several
    #: gateways share keeps it false from the commit until the gateway that answered
    #: releases the turn having handed the answer to a client still connected (see
    #: :meth:`~.coordinator.TurnCoordinator.release`): a gateway that died in between
    #: leaves it false. Other stores need not keep it (true).
    delivered: bool = True


@dataclass(slots=True)
class TurnAnswer:
    """The answer of a committed turn, as a retry of it gets it again."""

    key: AnswerKey
    #: The answer as the agent got it: JSON bytes, or the object rendered to them.
    body: bytes | dict[str, Any]
    #: The same answer with its ``prompt_token_ids`` array replaced by ``null`` (bytes),
    #: when the body carries one (a store need not keep the prompt's ids twice: they are
    #: the step's); ``None`` when the body has none.
    without_prompt_ids: bytes | None = None


@dataclass(slots=True)
class StoredAnswer:
    """An answer read back from a store."""

    #: The answer's JSON bytes.
    body: bytes
    #: Its ``prompt_token_ids`` are ``null`` in ``body`` and are this step's prompt ids
    #: (``None``: ``body`` is the answer as it was).
    prompt_ids_of_step: int | None = None


@dataclass(slots=True)
class TurnCommit:
    """One turn, written at once (see :meth:`RolloutStore.commit_turn`)."""

    #: The step's index: the number of steps stored before it.
    index: int
    step: RecordedStep
    counters: RolloutCounters
    #: The answer a retry replays (``None``: the turn answered nothing to replay, e.g. a
    #: prompt the engine refused; the previous answer stays).
    answer: TurnAnswer | None
    #: The claim this commit ends (the ``owner`` that claimed the turn): a store that
    #: keeps claims (Redis) releases it in the same write, as
    #: :meth:`~.coordinator.TurnCoordinator.release` would (one write a turn instead of
    #: two); ``None``: the claim goes on. Other stores ignore it.
    releases: str | None = None
    #: With ``releases``: the answer goes to a client still connected.
    delivered: bool | None = None


@dataclass(slots=True)
class RolloutRow:
    """A stored rollout."""

    registration: Registration
    counters: RolloutCounters
    #: Bumped by every write to the rollout: a copy whose revision is the stored one
    #: is current.
    revision: int
    #: Steps stored.
    steps: int
    #: The last answered turn (``None``: none yet).
    answer_key: AnswerKey | None = None
    #: Set by :meth:`RolloutStore.cancel_rollout`; never cleared by a later write.
    cancelled: bool = False


@dataclass(slots=True)
class PolicyState:
    """The policy version in effect (``None``: never announced)."""

    version: int | None = None
    updated_at: float | None = None


@dataclass(slots=True)
class StoreContents:
    """What :meth:`RolloutStore.open` found."""

    #: Every stored rollout (a backend several gateways share may leave it empty: they
    #: load rollouts on demand).
    rollouts: list[RolloutRow] = field(default_factory=list)
    policy: PolicyState = field(default_factory=PolicyState)
    #: Exit reports of stored rollouts, oldest first, and the last number given.
    exits: list[ExitReport] = field(default_factory=list)
    exit_cursor: int = 0
    #: Damage found and what was kept (logged at start; empty when all was well).
    damage: list[str] = field(default_factory=list)


class StoreEvents(Protocol):
    """What a gateway is told of the other gateways' changes on a store they share (see
    :meth:`~.coordinator.TurnCoordinator.watch`). Called on the gateway's event loop;
    must not block."""

    def exit_reported(self, report: ExitReport) -> None:
        """An exit report numbered by the store (by any gateway, this one included);
        reports come in number order."""
        ...

    def rollout_removed(self, rollout_id: str) -> None:
        """A rollout was unregistered (by any gateway): drop what is held of it."""
        ...

    def policy_announced(self, state: PolicyState) -> None:
        """The policy version in effect changed."""
        ...

    async def missed_events(self) -> None:
        """Events published while the gateway did not listen may have been missed (its
        channel was subscribed again after a gap): drop what is held of rollouts the store
        no longer has. (Its errors are the store's: the listener tries again.)"""
        ...


class RolloutStore(abc.ABC):
    """Where a gateway keeps what it must not lose (see the module doc).

    Writes are durable (to the backend's promise, see ``docs/state.md``) when their
    coroutine returns. Reads return copies the caller may keep.
    """

    #: Short name for logs and ``/health`` (``"memory"``, ``"sqlite"``...).
    name: str = "store"
    #: Whether what is stored survives this process.
    durable: bool = False

    @property
    @abc.abstractmethod
    def secret(self) -> bytes:
        """32 random bytes made when the store was created, the same for every process
        that opens it (request fingerprints are keyed with it). Valid after :meth:`open`."""

    @abc.abstractmethod
    async def open(self) -> StoreContents:
        """Open (creating when new), check and read what is stored. Idempotent: a second
        call returns what the first found (``serve`` opens the store in the app's startup
        before it binds, to refuse a store it cannot use before serving; the app's
        lifespan opens it again).

        Raises :class:`StoreUnavailableError` (cannot be opened or written),
        :class:`StoreVersionError` (another schema), :class:`StoreCorruptError` (damage
        beyond what can be kept: what was found damaged and kept is in
        :attr:`StoreContents.damage` otherwise).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish pending writes and release the store. Idempotent."""

    # -- rollouts ------------------------------------------------------------------------

    @abc.abstractmethod
    async def create_rollout(self, row: RolloutRow) -> None:
        """Store a new rollout (``row.revision`` and ``row.steps`` are 0). Raises
        :class:`RolloutExistsError` when its id is stored already."""

    @abc.abstractmethod
    async def load_rollout(self, rollout_id: str) -> RolloutRow | None:
        """The stored rollout ``rollout_id`` (``None``: not stored)."""

    async def stored_of(self, rollout_ids: list[str]) -> set[str]:
        """Which of ``rollout_ids`` are stored (a gateway that missed events checks the
        copies it holds: :meth:`StoreEvents.missed_events`)."""
        rows = await asyncio.gather(*(self.load_rollout(i) for i in rollout_ids))
        return {i for i, row in zip(rollout_ids, rows, strict=True) if row is not None}

    @abc.abstractmethod
    async def rollout_for_key(self, key_digest: str) -> str | None:
        """The id of the rollout whose key has this digest (``None``: none)."""

    @abc.abstractmethod
    async def save_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Replace the rollout's counters; returns its new revision. Raises
        :class:`UnknownRolloutError`."""

    @abc.abstractmethod
    async def cancel_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Mark the rollout cancelled (for good: no later write clears it) and replace
        its counters; returns its new revision. Raises :class:`UnknownRolloutError`."""

    @abc.abstractmethod
    async def delete_rollout(self, rollout_id: str) -> bool:
        """Drop the rollout with its steps, answer and exit report; whether it was stored."""

    # -- turns ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def commit_turn(self, rollout_id: str, commit: TurnCommit) -> int:
        """Write one turn atomically: its step at ``commit.index``, the counters, and (when
        given) the answer a retry replays (a store that keeps claims ends
        ``commit.releases``' claim in the same write). Returns the rollout's new revision.

        Raises :class:`TurnConflictError` (and writes nothing) when ``commit.index`` is not
        the number of steps stored, :class:`UnknownRolloutError` when the rollout is gone.
        """

    @abc.abstractmethod
    async def load_steps(self, rollout_id: str, start: int = 0) -> list[StepDelta]:
        """The stored steps from index ``start`` on, in order. Raises
        :class:`StoreCorruptError` when one fails its checks."""

    @abc.abstractmethod
    async def load_answer(self, rollout_id: str) -> StoredAnswer | None:
        """The last answered turn's answer (``None``: none stored)."""

    # -- exit reports and the policy version -----------------------------------------------

    @abc.abstractmethod
    async def save_exit(self, report: ExitReport) -> None:
        """Keep ``report`` (numbered already) as its rollout's exit report."""

    @abc.abstractmethod
    async def forget_exit(self, rollout_id: str) -> None:
        """Drop the rollout's exit report."""

    @abc.abstractmethod
    async def announce_policy(self, version: int, at: float) -> PolicyState:
        """Make ``version`` the one in effect unless a newer one is (forward only: a
        compare-and-set); returns the state in effect afterwards."""

    @abc.abstractmethod
    async def load_policy(self) -> PolicyState:
        """The policy version in effect as stored."""

    async def check(self) -> None:
        """Raise (:class:`StoreUnavailableError`, or what the backend's client raised)
        when the store cannot be used now; the gateway's health probe calls it every
        second or so (:mod:`~rollout_gateway.server.ops.health`), so it is cheap. This
        default reads the policy version (one round trip to a store across the network)."""
        await self.load_policy()


def answer_matches(
    key: AnswerKey,
    fingerprint: bytes,
    idempotency_key: str | None,
    *,
    is_retry: bool,
    now: float,
    window_s: float,
) -> bool:
    """Whether a request repeats the answered turn ``key`` describes, as
    :meth:`~.dedupe.TurnTracker.match` decides for a turn it holds: the same
    ``Idempotency-Key``; else the same body within ``window_s`` of the answer, marked as
    a retry or repeating an answer that did not reach its agent (:attr:`AnswerKey.delivered`;
    an unmarked repeat of a delivered answer is a new turn)."""
    if idempotency_key is not None and key.idempotency_key is not None:
        return idempotency_key == key.idempotency_key
    repeat = is_retry or not key.delivered
    return key.fingerprint == fingerprint and repeat and now - key.finished_at <= window_s


__all__ = [
    "AnswerKey",
    "PolicyState",
    "Registration",
    "RolloutCounters",
    "RolloutExistsError",
    "RolloutRow",
    "RolloutStore",
    "StoreContents",
    "StoreCorruptError",
    "StoreError",
    "StoreEvents",
    "StoreUnavailableError",
    "StoreVersionError",
    "StoredAnswer",
    "TurnAnswer",
    "TurnCommit",
    "TurnConflictError",
    "UnknownRolloutError",
    "answer_matches",
]
