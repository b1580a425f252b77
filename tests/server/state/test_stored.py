"""A gateway's copies of rollouts on a shared store, against removals it heard late or
never: a read racing another gateway's removal holds nothing, and the check after missed
events drops exactly the copies the store no longer has (never a rollout whose
registration is still being written)."""

from __future__ import annotations

import asyncio
import time

from support.shared_memory import MemoryCoordinator, SharedMemoryStore

from rollout_gateway.server.state.registry import RolloutRecord, RolloutRegistry
from rollout_gateway.server.state.rows import new_row
from rollout_gateway.server.state.store import RolloutRow
from rollout_gateway.server.state.stored import StoredRollouts


def record(rollout_id: str) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=rollout_id, model="m", sampling_params={}, max_turns=10, max_seq_len=None,
        upstream="http://u/v1", last_activity=time.monotonic(),
    )  # fmt: skip


class GatedReads(MemoryCoordinator):
    """Reads of the store that return only when :attr:`gate` opens (a slow round trip)."""

    def __init__(self, store: SharedMemoryStore) -> None:
        super().__init__(store)
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()

    async def find(self, rollout_id: str) -> RolloutRow | None:
        row = await super().find(rollout_id)
        self.reading.set()
        await self.gate.wait()
        return row


class GatedCreates(SharedMemoryStore):
    """A store whose new rollouts are written only when :attr:`gate` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def create_rollout(self, row: RolloutRow) -> None:
        await self.gate.wait()
        await super().create_rollout(row)


def gateway(store: SharedMemoryStore, coordinator: MemoryCoordinator) -> StoredRollouts:
    registry = RolloutRegistry(max_rollouts=10, ttl_s=600)
    return StoredRollouts(registry, store, coordinator, owner="b", lease_s=5.0, retry_window_s=5.0)


async def test_a_copy_read_while_another_gateway_removes_it_is_not_held() -> None:
    store = SharedMemoryStore()
    await store.create_rollout(new_row(record("r1")))
    coordinator = GatedReads(store)
    rollouts = gateway(store, coordinator)
    finding = asyncio.ensure_future(rollouts.find("r1"))
    await coordinator.reading.wait()  # the row is read: the removal comes after it
    assert await store.delete_rollout("r1")
    rollouts.removed_elsewhere("r1")  # heard before the read returned
    coordinator.gate.set()
    assert await finding is None
    assert len(rollouts.registry) == 0
    # A later read of a rollout not removed holds it as usual.
    await store.create_rollout(new_row(record("r2")))
    found = await rollouts.find("r2")
    assert found is not None and rollouts.registry.get("r2") is found


async def test_the_check_after_missed_events_drops_only_what_the_store_lost() -> None:
    store = GatedCreates()
    rollouts = gateway(store, MemoryCoordinator(store))
    store.gate.set()
    for rollout_id in ("kept", "removed"):
        await rollouts.register(record(rollout_id))
    store.gate.clear()
    registering = asyncio.ensure_future(rollouts.register(record("new")))
    await asyncio.sleep(0.01)  # held here, not yet stored
    assert rollouts.registry.get("new") is not None
    assert await store.delete_rollout("removed")  # at another gateway, never heard of
    assert await rollouts.unstored() == ["removed"]
    assert rollouts.registry.get("removed") is None
    store.gate.set()
    await registering
    assert {r.rollout_id for r in rollouts.registry.records()} == {"kept", "new"}
    assert await rollouts.unstored() == []
