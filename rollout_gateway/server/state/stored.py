"""The registry's records written through to the gateway's store, and read back.

:class:`StoredRollouts` is where the gateway's handlers find, register and drop rollouts:
register (:meth:`~StoredRollouts.register`), a turn's claim (:meth:`~StoredRollouts.claim`,
then :meth:`~StoredRollouts.release`) and unregister; what a turn or the control plane
changes of a record is :class:`~.ledger.RolloutLedger`'s. A record whose copy is not the
stored one (read back at start, written by another gateway, or left behind by a write that
failed) is brought up to date under the turn's claim, with what the claim says the copy
missed (:class:`~.coordinator.Claim`), never served stale. Whether another gateway may
hold a rollout, change it or use it is the coordinator's to say
(:class:`~.coordinator.TurnCoordinator`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson

from rollout_gateway.server.state.coordinator import Claim, HeldCopy, TurnCoordinator
from rollout_gateway.server.state.dedupe import TurnTracker, body_fingerprint
from rollout_gateway.server.state.expiry import ExpiredDeletions
from rollout_gateway.server.state.in_flight import InFlight
from rollout_gateway.server.state.registry import (
    AlreadyRegisteredError,
    Clock,
    RolloutRecord,
    RolloutRegistry,
)
from rollout_gateway.server.state.rows import apply_row, new_row, record_of
from rollout_gateway.server.state.store import (
    RolloutExistsError,
    RolloutRow,
    RolloutStore,
    StoreError,
    UnknownRolloutError,
    answer_matches,
)


class StoredRollouts:
    """The registry and the store, kept in step.

    Args:
        registry: the in-memory records.
        store: where what must outlive the process goes.
        coordinator: how turns are taken and what other gateways hold.
        owner: this gateway's id (it claims turns under it).
        lease_s: how long a claim lasts if this gateway dies holding it.
        retry_window_s: how long after its answer a turn still matches a retry.
        clock: the registry's monotonic clock.
        wall_clock: Unix time (stored times).
        on_load: called with each record read back for a rollout another gateway
            registered (the gateway pins it to an upstream).
    """

    def __init__(
        self,
        registry: RolloutRegistry,
        store: RolloutStore,
        coordinator: TurnCoordinator,
        *,
        owner: str,
        lease_s: float,
        retry_window_s: float,
        clock: Clock = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_load: Callable[[RolloutRecord], None] | None = None,
    ) -> None:
        self.registry = registry
        self.store = store
        self.coordinator = coordinator
        self.owner = owner
        self.lease_s = lease_s
        self.retry_window_s = retry_window_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.on_load = on_load
        #: Deletions of expired rollouts under way (a new registration of the id waits).
        self._deletions = ExpiredDeletions(registry, store, coordinator, wall_clock)
        self._seed: int | None = None
        #: Rollouts being registered or read here (a removal elsewhere must know them).
        self._in_flight = InFlight()

    def fingerprint(self, raw: bytes) -> bytes:
        """A request body's fingerprint, keyed with the store's secret (the same after a
        restart and on every gateway sharing the store)."""
        if self._seed is None:
            self._seed = int.from_bytes(self.store.secret[:8], "little")
        return body_fingerprint(raw, self._seed)

    # -- rollouts ------------------------------------------------------------------------

    def restore(self, rows: list[RolloutRow]) -> list[RolloutRecord]:
        """Hold the stored rollouts again (at start); their steps load on first use."""
        records = [self._record_of(row) for row in rows]
        for record in records:
            self.registry.hold(record)
        return records

    async def register(self, record: RolloutRecord) -> None:
        """Add ``record`` to the registry and the store (both or neither).

        Raises :class:`~.registry.AlreadyRegisteredError`,
        :class:`~.registry.RegistryFullError`, or the store's error.
        """
        await self._deletions.settled(record.rollout_id)
        self.registry.add(record)
        try:
            with self._in_flight.registration(record.rollout_id):
                await self.store.create_rollout(new_row(record))
        except BaseException as exc:
            self.registry.discard(record.rollout_id)
            if isinstance(exc, RolloutExistsError):
                raise AlreadyRegisteredError(record.rollout_id) from None
            raise

    async def find(self, rollout_id: str) -> RolloutRecord | None:
        """The live record of ``rollout_id``; read from the store when another gateway
        holds it."""
        record = self.registry.get(rollout_id)
        if record is None:
            row = await self._load(rollout_id)
            if row is not None and self.registry.get(rollout_id) is None:
                record = self._record_of(row)
                self.registry.hold(record)
                if self.on_load is not None:
                    self.on_load(record)
            record = self.registry.get(rollout_id)
        return record

    async def _load(self, rollout_id: str) -> RolloutRow | None:
        """The stored rollout, unless another gateway removed it while it was read (the
        removal's event may come before a read that began earlier returns)."""
        self._in_flight.read_started(rollout_id)
        try:
            row = await self.coordinator.find(rollout_id)
        finally:
            removed = self._in_flight.read_done(rollout_id)
        return None if removed else row

    def removed_elsewhere(self, rollout_id: str) -> None:
        """Another gateway removed ``rollout_id``: drop the copy held here (and any being
        read)."""
        self.registry.remove(rollout_id)
        self._in_flight.removed(rollout_id)

    async def unstored(self) -> list[str]:
        """The rollouts held here that the store no longer has (removed where this
        gateway did not hear of it); each is dropped here. Raises the store's error."""
        held = {r.rollout_id: r for r in self.registry.records()}
        for rollout_id in self._in_flight.registering:
            held.pop(rollout_id, None)
        stored = await self.store.stored_of(list(held))
        gone = []
        for rollout_id, record in held.items():
            # (A copy replaced while the store was asked is the store's newer one.)
            if rollout_id not in stored and self.registry.get(rollout_id) is record:
                self.removed_elsewhere(rollout_id)
                gone.append(rollout_id)
        return gone

    async def find_by_key(self, digest: str) -> RolloutRecord | None:
        """The live record whose key has ``digest`` (another gateway's, read from the
        store)."""
        record = self.registry.by_key_digest(digest)
        if record is None:
            rollout_id = await self.coordinator.find_key(digest)
            record = await self.find(rollout_id) if rollout_id is not None else None
        return record

    async def current(self, record: RolloutRecord) -> RolloutRecord:
        """``record`` brought up to date with the store (its steps loaded), to be read
        (a trajectory). Raises :class:`~.store.UnknownRolloutError` (the record is then
        dropped) when the store no longer holds it."""
        if self.vouches_for(record):
            return record
        claim = await self._caught_up(record)
        if claim.row is not None:
            async with record.lock:  # never under a turn of this gateway
                claim = await self._caught_up(record)
                if claim.row is not None:
                    await self._refresh(record, claim)
        return record

    async def unregister(self, rollout_id: str) -> RolloutRecord | None:
        """Forget ``rollout_id`` here and in the store; its record (``None``: unknown)."""
        record = await self.find(rollout_id)
        if record is None:
            return None
        await self.store.delete_rollout(rollout_id)
        self.registry.remove(rollout_id)
        return record

    def expired(self, record: RolloutRecord) -> None:
        """``record`` expired in the registry: drop it from the store in the background
        (when the coordinator says nobody else used it meanwhile)."""
        self._deletions.start(record.rollout_id)

    async def drain(self) -> None:
        """Wait for the background deletions (at shutdown)."""
        await self._deletions.drain()

    def vouches_for(self, record: RolloutRecord) -> bool:
        """Whether ``record`` is the stored rollout without asking the store (a gateway
        alone on it, the copy loaded and not left stale)."""
        return self.coordinator.vouches_for(record.revision if record.loaded else -1)

    # -- turns ---------------------------------------------------------------------------

    async def claim(self, record: RolloutRecord) -> None:
        """Take ``record``'s turn (other gateways on the store wait) and bring the record
        up to date with what the claim says it missed. Raises
        :class:`~.store.UnknownRolloutError` (the record is then dropped) when the store
        no longer holds it."""
        revision = record.revision if record.loaded else -1
        if self.coordinator.vouches_for(revision):
            return  # nothing to claim: this gateway alone writes the store
        held = HeldCopy(revision, record.recorder.num_steps)
        try:
            claim = await self.coordinator.claim(record.rollout_id, self.owner, self.lease_s, held)
        except UnknownRolloutError:
            self.registry.remove(record.rollout_id)
            raise
        if claim.row is not None:
            try:
                await self._refresh(record, claim)
            except BaseException:
                await self.release(record)
                raise

    async def release(self, record: RolloutRecord, *, delivered: bool | None = None) -> None:
        """Give ``record``'s turn back (``delivered``: see
        :meth:`~.coordinator.TurnCoordinator.release`); nothing for a copy the coordinator
        vouches for (it took no claim)."""
        if self.coordinator.vouches_for(record.revision if record.loaded else -1):
            return
        try:
            await self.coordinator.release(record.rollout_id, self.owner, delivered=delivered)
        except StoreError:  # a lost slot frees itself (its lease)
            pass

    async def repeated_answer(
        self,
        record: RolloutRecord,
        fingerprint: bytes,
        idempotency_key: str | None,
        *,
        is_retry: bool,
    ) -> bytes | None:
        """The stored answer a request repeats (a retry whose original was answered
        before a restart or on another gateway), or ``None``. Call under the claim."""
        key = record.answer_key
        if record.turns.last is not None:
            return None  # the turn tracker holds the last turn: it matched it already
        if key is None or not answer_matches(
            key, fingerprint, idempotency_key, is_retry=is_retry, now=self.wall_clock(),
            window_s=self.retry_window_s,
        ):  # fmt: skip
            return None
        stored = await self.store.load_answer(record.rollout_id)
        if stored is None:
            return None
        if stored.prompt_ids_of_step is None:
            return stored.body
        answer = orjson.loads(stored.body)  # stored answers are strict JSON
        answer["prompt_token_ids"] = record.recorder.prompt_ids_of(stored.prompt_ids_of_step)
        return orjson.dumps(answer)

    # -- loading -------------------------------------------------------------------------

    def _record_of(self, row: RolloutRow) -> RolloutRecord:
        record = record_of(row, clock=self.clock, wall_clock=self.wall_clock)
        record.turns = TurnTracker(self.retry_window_s, self.clock)
        return record

    async def _caught_up(self, record: RolloutRecord) -> Claim:
        try:
            return await self.coordinator.catch_up(record.rollout_id, _held(record))
        except UnknownRolloutError:
            self.registry.remove(record.rollout_id)
            raise

    async def _refresh(self, record: RolloutRecord, claim: Claim) -> None:
        """Make ``record`` the stored rollout ``claim.row``: with only the steps stored
        since its copy when it can, else all of them."""
        row = claim.row
        assert row is not None
        abandoned = set(row.counters.get("abandoned") or ())
        if not await self._catch_up(record, claim, abandoned):
            steps = claim.steps if record.recorder.num_steps == 0 else None  # (all of them)
            if steps is None:
                steps = await self.store.load_steps(record.rollout_id)
            record.reset_recorder()
            record.recorder.replay(steps[: row.steps], abandoned)
        apply_row(record, row)
        record.loaded = True
        record.turns.last = None  # this process's last turn may not be the last one now

    async def _catch_up(self, record: RolloutRecord, claim: Claim, abandoned: set[int]) -> bool:
        """Bring a current copy up to ``claim.row`` with only the steps stored since
        (gateways sharing a store take turns of one rollout in any order: reloading every
        step each time would cost a turn the whole trajectory). Whether it could: not
        when the copy is not current, or the row abandoned a step before the copy's last."""
        row = claim.row
        assert row is not None
        recorder = record.recorder
        held = recorder.num_steps
        known = set(recorder.abandoned_indexes())
        fresh = abandoned - known
        if (
            not record.loaded
            or record.revision < 0
            or row.steps < held
            or not known <= abandoned
            or any(index < held - 1 for index in fresh)
        ):
            return False
        if held - 1 in fresh and recorder.abandon_last() is None:
            return False
        if row.steps > held:
            steps = claim.steps
            if steps is None:
                steps = await self.store.load_steps(record.rollout_id, held)
            recorder.replay(steps[: row.steps - held], abandoned, start=held)
        return True


def _held(record: RolloutRecord) -> HeldCopy:
    """What ``record``'s copy holds, as a claim compares it with the store."""
    return HeldCopy(record.revision if record.loaded else -1, record.recorder.num_steps)


__all__ = ["StoredRollouts"]
