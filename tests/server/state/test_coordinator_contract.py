"""The contract of every backend's coordination (``rollout_gateway.server.state.coordinator``).

Parametrised over :data:`store_backends.BACKENDS`, each with the coordination its store
names (:meth:`~rollout_gateway.server.state.store.RolloutStore.coordinator`): a gateway
alone on its store (memory, SQLite) or gateways sharing one (the shared memory store,
Redis). What every coordinator keeps: a claim returns what the caller's copy missed, an
unknown rollout is refused, exit reports are numbered once and reach the boards, and what
a gateway may find, delete or vouch for. What gateways sharing a store keep besides: one
turn of a rollout at a time, a dead holder's turn freed by its lease, and whether the last
answer reached its agent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.shared_memory import coordination
from support.waiting import eventually

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.recorder import TrajectoryRecorder
from rollout_gateway.server.state.coordinator import HeldCopy, TurnCoordinator
from rollout_gateway.server.state.store import (
    AnswerKey,
    PolicyState,
    RolloutStore,
    TurnAnswer,
    TurnCommit,
    UnknownRolloutError,
)

from .store_backends import BACKENDS, Backend
from .test_store_contract import counters, record_turns, row


class Heard:
    """A gateway's events: exit reports onto its board, removals, announcements."""

    def __init__(self, coordinator: TurnCoordinator) -> None:
        self.board = coordinator.exit_board()
        self.removed: list[str] = []
        self.policies: list[int | None] = []
        self.missed = 0
        coordinator.watch(self)

    def exit_reported(self, report: ExitReport) -> None:
        self.board.apply(report)

    def rollout_removed(self, rollout_id: str) -> None:
        self.removed.append(rollout_id)

    def policy_announced(self, state: PolicyState) -> None:
        self.policies.append(state.version)

    async def missed_events(self) -> None:
        self.missed += 1


class Gateway:
    """One gateway's handles: its store, its coordinator, what it heard."""

    def __init__(self, store: RolloutStore) -> None:
        self.store = store
        self.coordinator = coordination(store)
        self.heard = Heard(self.coordinator)

    async def open(self) -> Gateway:
        await self.coordinator.open(await self.store.open())
        return self

    async def close(self) -> None:
        await self.coordinator.close()
        await self.store.close()


@pytest.fixture(params=BACKENDS, ids=[b.name for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param


@pytest.fixture
async def gateway(backend: Backend, tmp_path: Path) -> AsyncIterator[Gateway]:
    gateway = await Gateway(backend.make(tmp_path)).open()
    yield gateway
    await gateway.close()


def shared_only(backend: Backend, gateway: Gateway) -> None:
    if backend.peer is None or gateway.coordinator.vouches_for(0):
        pytest.skip(f"{backend.name}: one gateway alone on its store")


async def test_a_claim_returns_what_the_copy_missed(gateway: Gateway) -> None:
    store, coordinator = gateway.store, gateway.coordinator
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", 4096)
    record_turns(recorder)
    for index in range(3):
        await store.commit_turn("r1", TurnCommit(index, recorder._steps[index], counters(1), None))
    behind = HeldCopy(1, 1)
    if coordinator.vouches_for(behind.revision):  # a gateway alone: only a stale copy is behind
        behind = HeldCopy(-1, 1)
    claim = await coordinator.claim("r1", "gw-a", 30.0, behind)
    assert claim.row is not None and (claim.revision, claim.row.steps) == (3, 3)
    assert claim.row.registration == row().registration
    if claim.steps is not None:  # read with the claim: the steps since the copy's
        stored = await store.load_steps("r1", 1)  # (a claim may add the last step's check)
        assert [replace(s, check=None) for s in claim.steps] == [
            replace(s, check=None) for s in stored
        ]
    await coordinator.release("r1", "gw-a", delivered=None)
    current = await coordinator.claim("r1", "gw-a", 30.0, HeldCopy(3, 3))
    assert (current.revision, current.row, current.steps) == (3, None, None)
    await coordinator.release("r1", "gw-a", delivered=None)
    caught_up = await coordinator.catch_up("r1", behind)
    assert caught_up.row is not None and caught_up.row.steps == 3
    assert (await coordinator.catch_up("r1", HeldCopy(3, 3))).row is None


async def test_an_unknown_rollout_is_refused(gateway: Gateway) -> None:
    with pytest.raises(UnknownRolloutError):
        await gateway.coordinator.claim("nope", "gw-a", 30.0, HeldCopy(-1, 0))
    with pytest.raises(UnknownRolloutError):
        await gateway.coordinator.catch_up("nope", HeldCopy(-1, 0))


async def test_exit_reports_are_numbered_once_merged_and_heard(gateway: Gateway) -> None:
    await gateway.store.create_rollout(row())
    board = gateway.heard.board
    board.refused("r1", "max_turns_reached")  # the gateway's own report
    await eventually(lambda: board.cursor == 1)
    await gateway.coordinator.report_exit({"rollout_id": "r1", "exit_code": 3, "seq": 0})
    await eventually(lambda: board.cursor == 2)
    assert board.after(0) == [
        {"rollout_id": "r1", "exit_code": 3, "seq": 2, "refused": "max_turns_reached"}
    ]  # the refusal stays on the agent's later report
    await gateway.coordinator.report_exit(
        {"rollout_id": "r1", "exit_code": None, "seq": 0, "started": True}
    )  # a start report after a report: dropped, no number used
    await asyncio.sleep(0.05)
    assert board.cursor == 2


async def test_what_a_gateway_finds_and_deletes(backend: Backend, gateway: Gateway) -> None:
    coordinator = gateway.coordinator
    await gateway.store.create_rollout(row())
    opened = await coordinator.open(await gateway.store.open())  # (idempotent opens)
    found = await coordinator.find("r1")
    if coordinator.vouches_for(0):  # alone: it holds every stored rollout
        assert found is None and await coordinator.find_key("d" * 64) is None
        assert await coordinator.may_delete("r1", idle_s=60, now=time.time())
        assert [r.registration["rollout_id"] for r in opened] in ([], ["r1"])
        return
    assert found is not None and found.registration["rollout_id"] == "r1"
    assert await coordinator.find_key("d" * 64) == "r1"
    assert not await coordinator.may_delete("r1", idle_s=60, now=time.time())  # just now
    assert await coordinator.may_delete("r1", idle_s=60, now=time.time() + 61)


async def test_gateways_sharing_a_store_take_one_turn_of_a_rollout_at_a_time(
    backend: Backend, gateway: Gateway, tmp_path: Path
) -> None:
    shared_only(backend, gateway)
    assert backend.peer is not None
    other = await Gateway(backend.peer(gateway.store, tmp_path)).open()
    try:
        await gateway.store.create_rollout(row())
        await gateway.coordinator.claim("r1", "gw-a", 30.0, HeldCopy(0, 0))
        waiting = asyncio.ensure_future(other.coordinator.claim("r1", "gw-b", 30.0, HeldCopy(0, 0)))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        revision = await gateway.store.save_rollout("r1", counters(1))
        await gateway.coordinator.release("r1", "gw-a", delivered=None)
        claim = await asyncio.wait_for(waiting, 10)
        assert claim.revision == revision and claim.row is not None  # it sees the write
        await other.coordinator.release("r1", "gw-b", delivered=None)
        # A holder that died (closed: nothing renews its claim) frees the turn when its
        # lease ends.
        await gateway.coordinator.claim("r1", "gw-dead", 0.1, HeldCopy(revision, 0))
        await gateway.close()
        held = HeldCopy(revision, 0)
        claim = await asyncio.wait_for(other.coordinator.claim("r1", "gw-b", 30.0, held), 10)
        assert claim.revision == revision
        # The other gateway hears of exit reports and removals.
        await other.coordinator.report_exit({"rollout_id": "r1", "exit_code": 0, "seq": 0})
        await eventually(lambda: other.heard.board.cursor == 1)
        await other.store.delete_rollout("r1")
        await eventually(lambda: other.heard.removed == ["r1"])
    finally:
        if other.store is not gateway.store:
            await other.close()


async def test_a_shared_store_keeps_whether_the_last_answer_was_delivered(
    backend: Backend, gateway: Gateway
) -> None:
    shared_only(backend, gateway)
    store, coordinator = gateway.store, gateway.coordinator
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", None)
    record_turns(recorder)

    async def delivered() -> bool | None:
        loaded = await store.load_rollout("r1")
        assert loaded is not None and loaded.answer_key is not None
        return loaded.answer_key.delivered

    for index, handed in enumerate([True, False, None]):
        await coordinator.claim("r1", "gw-a", 30.0, HeldCopy(-1, index))
        answer = TurnAnswer(AnswerKey(b"f" * 16, None, 1.0, index), b"{}")
        step = recorder._steps[index]
        await store.commit_turn("r1", TurnCommit(index, step, counters(1), answer))
        assert await delivered() is False  # until the answering gateway says
        await coordinator.release("r1", "gw-a", delivered=handed)
        assert await delivered() is bool(handed)  # (a gateway that died says nothing)
    # A commit may end its claim, saying whether its answer was handed out.
    await coordinator.claim("r1", "gw-a", 30.0, HeldCopy(-1, 3))
    answer = TurnAnswer(AnswerKey(b"g" * 16, None, 1.0, 3), b"{}")
    commit = TurnCommit(3, recorder._steps[3], counters(1), answer, "gw-a", True)
    await store.commit_turn("r1", commit)
    assert await delivered() is True


async def test_the_policy_version_is_read_where_another_gateway_announced_it(
    backend: Backend, gateway: Gateway
) -> None:
    await gateway.store.announce_policy(4, 1.0)
    await gateway.coordinator.refresh_policy()
    heard: Any = gateway.heard.policies
    if gateway.coordinator.vouches_for(0):
        assert heard == []  # alone: the gateway announced it itself
    else:
        await eventually(lambda: 4 in heard)
