"""Expired rollouts deleted from the store in the background: deleted unless another
gateway used them, a store failure kept (not raised), a new registration of the id waits
for the deletion, shutdown waits for all of them."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rollout_gateway.server.state.coordinator import LocalCoordinator
from rollout_gateway.server.state.expiry import ExpiredDeletions
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.registry import RolloutRegistry
from rollout_gateway.server.state.rows import new_row
from rollout_gateway.server.state.store import StoreError

from .test_stored import record


class UsedElsewhere(LocalCoordinator):
    """A coordinator that says another gateway used ``used`` since; it records the idle
    time each question was asked with."""

    def __init__(self, store: MemoryStore, used: set[str]) -> None:
        super().__init__(store)
        self.used = used
        self.asked: list[tuple[str, float, float]] = []

    async def may_delete(self, rollout_id: str, *, idle_s: float, now: float) -> bool:
        self.asked.append((rollout_id, idle_s, now))
        return rollout_id not in self.used


class GatedDeletes(MemoryStore):
    """A store whose deletions finish when :attr:`gate` opens, or fail with ``failing``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.failing: str | None = None

    async def delete_rollout(self, rollout_id: str) -> bool:
        await self.gate.wait()
        if rollout_id == self.failing:
            raise StoreError("disk full")
        return await super().delete_rollout(rollout_id)


def deletions_of(store: MemoryStore) -> ExpiredDeletions:
    """The deletions of a lone gateway on ``store`` (a minute's TTL, the wall clock)."""
    registry = RolloutRegistry(max_rollouts=10, ttl_s=60)
    return ExpiredDeletions(registry, store, LocalCoordinator(store), time.time)


async def stored(store: MemoryStore, *ids: str) -> None:
    for rollout_id in ids:
        await store.create_rollout(new_row(record(rollout_id)))


async def test_an_expired_rollout_goes_unless_another_gateway_used_it() -> None:
    store = GatedDeletes()
    store.gate.set()
    await stored(store, "idle", "used")
    coordinator = UsedElsewhere(store, {"used"})
    deletions = ExpiredDeletions(
        RolloutRegistry(max_rollouts=10, ttl_s=600), store, coordinator, lambda: 1e9
    )
    deletions.start("idle")
    deletions.start("used")
    await deletions.drain()
    assert await store.stored_of(["idle", "used"]) == {"used"}
    assert sorted(coordinator.asked) == [("idle", 600, 1e9), ("used", 600, 1e9)]


async def test_a_registration_waits_for_the_deletion_and_shutdown_for_all() -> None:
    store = GatedDeletes()
    await stored(store, "r1")
    deletions = deletions_of(store)
    deletions.start("r1")
    waiting = asyncio.ensure_future(deletions.settled("r1"))
    draining = asyncio.ensure_future(deletions.drain())
    await asyncio.sleep(0.01)
    assert not waiting.done() and not draining.done()
    store.gate.set()
    await asyncio.wait_for(asyncio.gather(waiting, draining), 5)
    assert await store.stored_of(["r1"]) == set()
    await deletions.settled("r1")  # none under way: returns at once


async def test_a_cancelled_waiter_leaves_the_deletion_running() -> None:
    store = GatedDeletes()
    await stored(store, "r1")
    deletions = deletions_of(store)
    deletions.start("r1")
    waiting = asyncio.ensure_future(deletions.settled("r1"))
    await asyncio.sleep(0.01)
    waiting.cancel()
    store.gate.set()
    await deletions.drain()
    assert await store.stored_of(["r1"]) == set()


async def test_a_store_failure_is_logged_and_the_row_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = GatedDeletes()
    store.failing = "r1"
    store.gate.set()
    await stored(store, "r1")
    deletions = deletions_of(store)
    with caplog.at_level(logging.WARNING, logger="rollout_gateway.server"):
        deletions.start("r1")
        await deletions.drain()
    assert await store.stored_of(["r1"]) == {"r1"}
    assert "rollout=r1 expired but not deleted from the store: disk full" in caplog.text
