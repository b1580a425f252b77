"""The registry of rollouts: records, per-rollout turn lock, idle expiry, size bound.

The records are the gateway's working copy of its rollouts; what must outlive the
process is written through to the gateway's store (:mod:`.stored`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway.protocol import UNLIMITED_TURNS, RolloutStatus, TruncationReason
from rollout_gateway.server.engines.upstream_request import FlatSampling, flatten_sampling_params
from rollout_gateway.server.recording.recorder import TrajectoryRecorder
from rollout_gateway.server.state.dedupe import TurnTracker
from rollout_gateway.server.state.limits_v1 import TokenBudget
from rollout_gateway.server.state.store import AnswerKey

#: A monotonic clock in seconds (injectable so tests can expire rollouts instantly).
Clock = Callable[[], float]


def key_digest(api_key: str) -> str:
    """The digest a rollout's key is known by (SHA-256, hex): the gateway keeps and
    stores this, never the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


#: Compared against when there is no key to compare with (an unknown rollout takes as
#: long to refuse as a wrong key); the digest of no key.
_NO_DIGEST = "0" * 64


def key_matches(api_key: str, digest: str | None) -> bool:
    """Whether ``api_key`` is the key of ``digest``, in the same time whether ``digest``
    is one or ``None`` (no rollout)."""
    same = hmac.compare_digest(key_digest(api_key), digest or _NO_DIGEST)
    return same and digest is not None


@dataclass
class RolloutRecord:
    """Everything the gateway knows about one registered rollout."""

    rollout_id: str
    model: str
    sampling_params: dict[str, Any]
    max_turns: int
    max_seq_len: int | None
    upstream: str
    last_activity: float
    #: Digest of the per-rollout key (:func:`key_digest`; ``None``: keys are off).
    key_digest: str | None = None
    status: RolloutStatus = "active"
    num_turns: int = 0
    #: Budgets (see :mod:`rollout_gateway.server.agents.limits`); ``None``: no bound.
    max_total_completion_tokens: int | None = None
    max_context_tokens: int | None = None
    max_message_bytes: int | None = None
    completion_tokens: int = 0
    message_bytes: int = 0
    #: The limit that refused a turn (the trajectory reports it).
    truncation_reason: TruncationReason | None = None
    #: Engine calls that failed, the most recent ones (``protocol.FailedTurn``).
    failed_turns: list[dict[str, Any]] = field(default_factory=list)
    #: Turns queued, running and the last answered one (retry deduplication).
    turns: TurnTracker = field(default_factory=lambda: TurnTracker(120.0, time.monotonic))
    recorder: TrajectoryRecorder = field(init=False)
    #: Serialises the turns of this rollout; other rollouts never wait on it.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: False once unregistered or expired (a turn waiting on the lock must then stop).
    live: bool = True
    #: Why the rollout ended short (``"context_length_exceeded"``), if it did.
    truncated_reason: str | None = None
    #: verifiers v1 token caps of the rollout (``server/state/limits_v1.py``), if it set any.
    token_budget: TokenBudget | None = None
    #: Reported on every step (a uuid per rollout).
    trajectory_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    #: Wall time of the registration.
    registered_at: float = field(default_factory=time.time)
    #: The store's revision of the rollout this copy reflects (-1: not current).
    revision: int = 0
    #: Whether the recorder holds the stored steps (false for a rollout read back from
    #: the store until its first use).
    loaded: bool = True
    #: The last answered turn, which a retry from before a restart (or from another
    #: gateway) may repeat (see :func:`~.store.answer_matches`).
    answer_key: AnswerKey | None = None
    #: What the rollout's previous request in a dialect other than chat translated to
    #: (:mod:`~rollout_gateway.server.dialects.memo`): a cache checked by equality, not
    #: persisted (the next parse after a restart translates everything).
    dialect_memo: Any = None
    #: The rollout's previous dialect body's bytes and where its conversation is in them
    #: (:class:`~rollout_gateway.server.http.body_prefix.BodyPrefix`): the next body's
    #: parse skips the history it repeats. Not persisted either.
    body_prefix: Any = None
    #: ``sampling_params`` flattened (:attr:`flat_sampling`), made on first use.
    _flat_sampling: FlatSampling | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.reset_recorder()

    @property
    def flat_sampling(self) -> FlatSampling:
        """The registered sampling params as top-level request fields
        (:func:`~rollout_gateway.server.engines.upstream_request.flatten_sampling_params`),
        flattened once: registered params never change, and every turn reads them."""
        flat = self._flat_sampling
        if flat is None:
            flat = self._flat_sampling = flatten_sampling_params(self.sampling_params)
        return flat

    def reset_recorder(self) -> None:
        """Give the record an empty recorder (its steps are then replayed into it)."""
        self.recorder = TrajectoryRecorder(self.trajectory_id, self.max_seq_len)

    @property
    def at_max_turns(self) -> bool:
        """Whether the rollout used all its turns."""
        return self.max_turns != UNLIMITED_TURNS and self.num_turns >= self.max_turns


class RegistryFullError(Exception):
    """The registry holds ``max_rollouts`` rollouts already."""


class AlreadyRegisteredError(Exception):
    """A rollout with this id is registered already."""


class RolloutRegistry:
    """Registered rollouts by id, bounded in size, expiring after ``ttl_s`` idle seconds.

    Single event loop, no awaits inside methods: the dict needs no lock.
    """

    def __init__(
        self,
        *,
        max_rollouts: int,
        ttl_s: float,
        clock: Clock = time.monotonic,
        on_remove: Callable[[RolloutRecord], None] | None = None,
        on_expire: Callable[[RolloutRecord], None] | None = None,
    ) -> None:
        self.max_rollouts = max_rollouts
        self.ttl_s = ttl_s
        self.clock = clock
        self._on_remove = on_remove  # e.g. release the upstream pin
        self._on_expire = on_expire  # e.g. count expiries
        self._records: dict[str, RolloutRecord] = {}
        self._by_key: dict[str, RolloutRecord] = {}  # by key digest

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[RolloutRecord]:
        """Snapshot of the live records."""
        return list(self._records.values())

    def add(self, record: RolloutRecord) -> None:
        """Register ``record`` (expiring idle ones first when the registry is full)."""
        if record.rollout_id in self._records:
            existing = self._records[record.rollout_id]
            if not self._expired(existing):
                raise AlreadyRegisteredError(record.rollout_id)
            self._expire(existing)
        if len(self._records) >= self.max_rollouts:
            self.expire_idle()
            if len(self._records) >= self.max_rollouts:
                raise RegistryFullError(
                    f"gateway is at its limit of {self.max_rollouts} registered rollouts; "
                    "unregister finished rollouts or raise --max-rollouts"
                )
        self.hold(record)

    def hold(self, record: RolloutRecord) -> None:
        """Hold ``record`` without the checks of :meth:`add` (a rollout read back from the
        store: it was registered already)."""
        self._records[record.rollout_id] = record
        if record.key_digest is not None:
            self._by_key[record.key_digest] = record

    def has_room(self) -> bool:
        """Whether :meth:`add` would take one more rollout (expiring idle ones to make room)."""
        if len(self._records) >= self.max_rollouts:
            self.expire_idle()
        return len(self._records) < self.max_rollouts

    def by_key(self, api_key: str) -> RolloutRecord | None:
        """The live record whose per-rollout key is ``api_key`` (bearer-key routing)."""
        return self.by_key_digest(key_digest(api_key))

    def by_key_digest(self, digest: str) -> RolloutRecord | None:
        """The live record whose key has this digest."""
        record = self._by_key.get(digest)
        if record is None:
            return None
        return self.get(record.rollout_id)

    def get(self, rollout_id: str) -> RolloutRecord | None:
        """The live record of ``rollout_id`` (``None`` when unknown or expired)."""
        record = self._records.get(rollout_id)
        if record is not None and self._expired(record):
            self._expire(record)
            return None
        return record

    def touch(self, record: RolloutRecord) -> None:
        """Note activity on ``record`` (postpones its expiry)."""
        record.last_activity = self.clock()

    def remove(self, rollout_id: str) -> RolloutRecord | None:
        """Drop a rollout; returns its record (``None`` when unknown)."""
        record = self._records.pop(rollout_id, None)
        if record is not None:
            record.live = False
            if record.key_digest is not None:
                self._by_key.pop(record.key_digest, None)
            if self._on_remove is not None:
                self._on_remove(record)
        return record

    def discard(self, rollout_id: str) -> None:
        """Drop a record :meth:`add` took but whose registration did not go through (no
        removal hook runs)."""
        record = self._records.pop(rollout_id, None)
        if record is not None:
            record.live = False
            if record.key_digest is not None:
                self._by_key.pop(record.key_digest, None)

    def expire_idle(self) -> list[RolloutRecord]:
        """Drop every rollout idle for longer than the TTL; returns the dropped ones."""
        expired = [r for r in self._records.values() if self._expired(r)]
        for record in expired:
            self._expire(record)
        return expired

    def _expire(self, record: RolloutRecord) -> None:
        self.remove(record.rollout_id)
        if self._on_expire is not None:
            self._on_expire(record)

    def _expired(self, record: RolloutRecord) -> bool:
        # A turn in progress is activity even if it runs longer than the TTL.
        busy = record.lock.locked() or bool(record.turns.pending)
        return not busy and self.clock() - record.last_activity > self.ttl_s


__all__ = [
    "AlreadyRegisteredError",
    "Clock",
    "RegistryFullError",
    "RolloutRecord",
    "RolloutRegistry",
    "key_digest",
    "key_matches",
]
