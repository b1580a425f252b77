"""The registry's records written through to the gateway's store, and read back.

:class:`StoredRollouts` is where the gateway's handlers find, register and drop rollouts:
register (:meth:`~StoredRollouts.register`), a turn's claim (:meth:`~StoredRollouts.claim`,
then :meth:`~StoredRollouts.release`) and unregister; what a turn or the control plane
changes of a record is :class:`~.ledger.RolloutLedger`'s. A record whose copy is not the
stored one (read back at start, written by another gateway, or left behind by a write that
failed) is brought up to date from the store under the turn's claim, never served stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.state.dedupe import TurnTracker, body_fingerprint
from rollout_gateway.server.state.registry import (
    AlreadyRegisteredError,
    Clock,
    RolloutRecord,
    RolloutRegistry,
)
from rollout_gateway.server.state.rows import apply_row, new_row, record_of
from rollout_gateway.server.state.store import (
    GatewayStore,
    RolloutExistsError,
    RolloutRow,
    StoreError,
    UnknownRolloutError,
    answer_matches,
)

logger = logging.getLogger("rollout_gateway.server")


class StoredRollouts:
    """The registry and the store, kept in step.

    Args:
        registry: the in-memory records.
        store: where what must outlive the process goes.
        owner: this gateway's id (it claims turns under it).
        lease_s: how long a claim lasts if this gateway dies holding it.
        retry_window_s: how long after its answer a turn still matches a retry.
        clock: the registry's monotonic clock.
        wall_clock: Unix time (stored times).
        on_load: called with each record read back from a shared store (the gateway pins
            it to an upstream).
    """

    def __init__(
        self,
        registry: RolloutRegistry,
        store: GatewayStore,
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
        self.owner = owner
        self.lease_s = lease_s
        self.retry_window_s = retry_window_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.on_load = on_load
        #: Deletions of expired rollouts under way (a new registration of the id waits).
        self._deleting: dict[str, asyncio.Task[bool]] = {}
        #: Exit-report writes under way (fire and forget: a report is a hint).
        self._exit_writes: set[asyncio.Task[None]] = set()
        self._seed: int | None = None

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
        pending = self._deleting.get(record.rollout_id)
        if pending is not None:
            await asyncio.shield(pending)
        self.registry.add(record)
        try:
            await self.store.create_rollout(new_row(record))
        except BaseException as exc:
            self.registry.discard(record.rollout_id)
            if isinstance(exc, RolloutExistsError):
                raise AlreadyRegisteredError(record.rollout_id) from None
            raise

    async def find(self, rollout_id: str) -> RolloutRecord | None:
        """The live record of ``rollout_id``; from a shared store when not held here."""
        record = self.registry.get(rollout_id)
        if record is None and self.store.shared:
            row = await self.store.load_rollout(rollout_id)
            if row is not None and self.registry.get(rollout_id) is None:
                record = self._record_of(row)
                self.registry.hold(record)
                if self.on_load is not None:
                    self.on_load(record)
            record = self.registry.get(rollout_id)
        return record

    async def find_by_key(self, digest: str) -> RolloutRecord | None:
        """The live record whose key has ``digest``; from a shared store when not held."""
        record = self.registry.by_key_digest(digest)
        if record is None and self.store.shared:
            rollout_id = await self.store.rollout_for_key(digest)
            record = await self.find(rollout_id) if rollout_id is not None else None
        return record

    async def current(self, record: RolloutRecord) -> RolloutRecord:
        """``record`` brought up to date with the store (its steps loaded), to be read
        (a trajectory). Raises :class:`~.store.UnknownRolloutError` (the record is then
        dropped) when the store no longer holds it."""
        if self.store.shared:
            row = await self.store.load_rollout(record.rollout_id)
            if row is None or row.revision != record.revision or not record.loaded:
                async with record.lock:  # never under a turn of this gateway
                    await self._refresh(record, await self.store.load_rollout(record.rollout_id))
        elif not record.loaded or record.revision < 0:
            async with record.lock:
                if not record.loaded or record.revision < 0:
                    await self._refresh(record, await self.store.load_rollout(record.rollout_id))
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
        """``record`` expired in the registry: drop it from the store in the background."""
        rollout_id = record.rollout_id
        task = asyncio.get_running_loop().create_task(self._delete_expired(rollout_id))
        self._deleting[rollout_id] = task
        task.add_done_callback(lambda _: self._forget_deletion(rollout_id, task))

    async def _delete_expired(self, rollout_id: str) -> bool:
        try:
            if self.store.shared:  # idle here; maybe not at the other gateways
                row = await self.store.load_rollout(rollout_id)
                changed = row.counters.get("updated_at", 0.0) if row is not None else 0.0
                if self.wall_clock() - changed <= self.registry.ttl_s:
                    return False  # only dropped from this gateway's cache
            return await self.store.delete_rollout(rollout_id)
        except StoreError as exc:  # kept: it expires again after a restart
            logger.warning("rollout=%s expired but not deleted from the store: %s", rollout_id, exc)
            return False

    def _forget_deletion(self, rollout_id: str, task: asyncio.Task[bool]) -> None:
        if self._deleting.get(rollout_id) is task:
            del self._deleting[rollout_id]

    async def drain(self) -> None:
        """Wait for the background writes (at shutdown)."""
        while self._deleting or self._exit_writes:
            pending = [*self._deleting.values(), *self._exit_writes]
            await asyncio.gather(*pending, return_exceptions=True)

    # -- exit reports (the board's journal) -------------------------------------------------

    def exit_saved(self, report: ExitReport) -> None:
        """Keep ``report`` in the store (in the background)."""
        self._exit_write(self.store.save_exit(dict(report)))  # type: ignore[arg-type]

    def exit_forgotten(self, rollout_id: str) -> None:
        """Drop the rollout's report from the store (in the background)."""
        self._exit_write(self.store.forget_exit(rollout_id))

    def _exit_write(self, write: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(self._quietly(write))
        self._exit_writes.add(task)
        task.add_done_callback(self._exit_writes.discard)

    @staticmethod
    async def _quietly(write: Coroutine[Any, Any, None]) -> None:
        try:
            await write
        except StoreError as exc:  # a report is a hint: the env also polls its sandbox
            logger.warning("an exit report was not stored: %s", exc)

    # -- turns ---------------------------------------------------------------------------

    async def claim(self, record: RolloutRecord) -> None:
        """Take ``record``'s turn slot (other gateways on a shared store wait) and bring
        the record up to date. Raises :class:`~.store.UnknownRolloutError` (the record is
        then dropped) when the store no longer holds it."""
        if not self.store.shared and record.loaded and record.revision >= 0:
            return  # this process is the store's only writer: its copy is current
        try:
            revision = await self.store.claim_turn(record.rollout_id, self.owner, self.lease_s)
        except UnknownRolloutError:
            self.registry.remove(record.rollout_id)
            raise
        if revision != record.revision or not record.loaded:
            try:
                await self._refresh(record, await self.store.load_rollout(record.rollout_id))
            except BaseException:
                await self.release(record)
                raise

    async def release(self, record: RolloutRecord, *, delivered: bool | None = None) -> None:
        """Give ``record``'s turn slot back (``delivered``: see
        :meth:`~.store.GatewayStore.release_turn`)."""
        if not self.store.shared:
            return  # no slot was taken
        with contextlib.suppress(StoreError):  # a lost slot frees itself (its lease)
            await self.store.release_turn(record.rollout_id, self.owner, delivered=delivered)

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
        if record.turns.last is not None and not self.store.shared:
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

    async def _refresh(self, record: RolloutRecord, row: RolloutRow | None) -> None:
        if row is None:
            self.registry.remove(record.rollout_id)
            raise UnknownRolloutError(record.rollout_id)
        abandoned = set(row.counters.get("abandoned") or ())
        if not await self._catch_up(record, row, abandoned):
            steps = await self.store.load_steps(record.rollout_id)
            record.reset_recorder()
            record.recorder.replay(steps[: row.steps], abandoned)
        apply_row(record, row)
        record.loaded = True
        record.turns.last = None  # this process's last turn may not be the last one now

    async def _catch_up(self, record: RolloutRecord, row: RolloutRow, abandoned: set[int]) -> bool:
        """Bring a current copy up to ``row`` with only the steps stored since (gateways
        sharing a store take turns of one rollout in any order: reloading every step
        each time would cost a turn the whole trajectory). Whether it could: not when the
        copy is not current, or the row abandoned a step before the copy's last."""
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
            steps = await self.store.load_steps(record.rollout_id, held)
            recorder.replay(steps[: row.steps - held], abandoned, start=held)
        return True


__all__ = ["StoredRollouts"]
