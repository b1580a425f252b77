"""The Redis store against a real Redis, as several gateways share it: one turn of a
rollout at a time across stores, a dead gateway's lease taken over, a late commit
refused, exit reports numbered once for all, policy versions forward only, another
layout refused, an unreachable server reported. Each gateway is a store and its
coordinator (:class:`Gateway`). (What every backend does alike is in the backend and
coordinator contract tests.)"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from support.local_cluster import RedisServer, free_port
from support.waiting import eventually

from rollout_gateway.server.state.backends import coordinator_for

from .redis_fixtures import redis_server

pytest.importorskip("redis")

from rollout_gateway.protocol import ExitReport  # noqa: E402
from rollout_gateway.server.recording.steps import CheckState, RecordedStep  # noqa: E402
from rollout_gateway.server.recording.token_branches import StepIds  # noqa: E402
from rollout_gateway.server.state.coordinator import Claim, HeldCopy  # noqa: E402
from rollout_gateway.server.state.redis_backend.store import LAYOUT, RedisStore  # noqa: E402
from rollout_gateway.server.state.store import (  # noqa: E402
    AnswerKey,
    PolicyState,
    RolloutExistsError,
    RolloutRow,
    StoreCorruptError,
    StoreUnavailableError,
    StoreVersionError,
    TurnAnswer,
    TurnCommit,
    TurnConflictError,
    UnknownRolloutError,
)


async def reopened(store: RedisStore) -> Any:
    """What a new gateway's store on the same Redis and prefix finds at open."""
    again = RedisStore(store.url, prefix=store.prefix)
    try:
        return await again.open()
    finally:
        await again.close()


class Heard:
    """What a gateway's store tells it (``StoreEvents``)."""

    def __init__(self) -> None:
        self.exits: list[ExitReport] = []
        self.removed: list[str] = []
        self.policies: list[int | None] = []
        self.missed = 0

    def exit_reported(self, report: ExitReport) -> None:
        self.exits.append(report)

    def rollout_removed(self, rollout_id: str) -> None:
        self.removed.append(rollout_id)

    def policy_announced(self, state: PolicyState) -> None:
        self.policies.append(state.version)

    async def missed_events(self) -> None:
        self.missed += 1


class Gateway:
    """One gateway on Redis: its store and its coordinator (what it hears: ``heard``);
    the store's calls are the gateway's, and a turn's claim returns the revision."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.coordinator = coordinator_for(store)
        self.coordinator.exit_board()
        self.heard = Heard()
        self.coordinator.watch(self.heard)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def open(self) -> Any:
        contents = await self.store.open()
        await self.coordinator.open(contents)
        return contents

    async def close(self) -> None:
        await self.coordinator.close()
        await self.store.close()

    async def claim(self, rollout_id: str, owner: str, lease_s: float, held: HeldCopy) -> Claim:
        return await self.coordinator.claim(rollout_id, owner, lease_s, held)

    async def claim_turn(self, rollout_id: str, owner: str, lease_s: float) -> int:
        return (await self.claim(rollout_id, owner, lease_s, HeldCopy(-1, 0))).revision

    async def release_turn(self, rollout_id: str, owner: str, delivered: bool = False) -> None:
        await self.coordinator.release(rollout_id, owner, delivered=delivered)

    async def report_exit(self, report: ExitReport) -> ExitReport | None:
        return await self.coordinator.number_exit(report)

    async def exits_after(self, after: int) -> list[ExitReport]:
        return await self.store.exits.after(after)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from redis_server(tmp_path_factory.mktemp("redis"))


_prefixes = iter(range(1_000_000))


@pytest.fixture
async def gateways(server: RedisServer) -> AsyncIterator[list[Gateway]]:
    """Two gateways on one Redis, under a prefix of this test's own."""
    prefix = f"t{next(_prefixes)}:"
    gateways = [Gateway(RedisStore(server.url, prefix=prefix, lease_s=2.0)) for _ in range(2)]
    for gateway in gateways:
        await gateway.open()
    yield gateways
    for gateway in gateways:
        await gateway.close()


def _exit(rollout_id: str, code: int | None) -> Any:
    return {"rollout_id": rollout_id, "exit_code": code, "seq": 0}


def _row(rollout_id: str = "r1", key_digest: str | None = "kd") -> RolloutRow:
    registration: Any = {
        "rollout_id": rollout_id, "model": "m", "sampling_params": {}, "max_turns": 10,
        "max_seq_len": None, "upstream": "http://u/v1", "key_digest": key_digest,
        "trajectory_id": "traj", "token_caps": None,
    }  # fmt: skip
    return RolloutRow(registration, {"status": "active", "num_turns": 0}, revision=0, steps=0)


def _step(n: int) -> RecordedStep:
    segment = array("i", range(10 + n))
    tokens = StepIds(segment, 0, 8 + n, 10 + n, array("f", [-0.5, -0.25]), False, False)
    user, assistant = {"role": "user", "content": f"u{n}"}, {"role": "assistant", "content": "a"}
    return RecordedStep(0, [user], [assistant], tokens, False, {"n": n})


def _commit(index: int, answer: bytes | None = b'{"id": "x"}') -> TurnCommit:
    key = AnswerKey(b"\x01" * 16, None, time.time(), index)
    return TurnCommit(
        index, _step(index), {"status": "active", "num_turns": index + 1},
        TurnAnswer(key, answer) if answer is not None else None,
    )  # fmt: skip


async def test_damaged_records_are_refused_not_served(gateways: list[Gateway]) -> None:
    a, _ = gateways
    await a.create_rollout(_row())
    await a.commit_turn("r1", _commit(0))
    await a.commit_turn("r1", _commit(1))
    steps = await a.load_steps("r1")
    assert [s.extras for s in steps] == [{"n": 0}, {"n": 1}]
    stored = await a._cmd("LINDEX", f"{a.prefix}s:r1", 1)
    await a._cmd("LSET", f"{a.prefix}s:r1", 1, stored[:-20])  # truncated
    with pytest.raises(StoreCorruptError, match="rollout r1: step 1"):
        await a.load_steps("r1")
    counters = await a._cmd("HGET", f"{a.prefix}r:r1", "counters")
    await a._cmd("HSET", f"{a.prefix}r:r1", "counters", b"x" + counters[1:])  # flipped
    with pytest.raises(StoreCorruptError, match="rollout r1: counters"):
        await a.load_rollout("r1")


async def test_one_turn_of_a_rollout_at_a_time_across_gateways(
    gateways: list[Gateway],
) -> None:
    a, b = gateways
    await a.create_rollout(_row())
    with pytest.raises(RolloutExistsError):
        await b.create_rollout(_row())
    assert await b.rollout_for_key("kd") == "r1"
    assert await a.claim_turn("r1", "gw-a", 2.0) == 0
    waiting = asyncio.ensure_future(b.claim_turn("r1", "gw-b", 2.0))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # gateway b waits while a's turn runs
    assert await a.commit_turn("r1", _commit(0)) == 1
    await a.release_turn("r1", "gw-a")
    assert await asyncio.wait_for(waiting, 5) == 1  # woken; sees a's turn (revision 1)
    steps = await b.load_steps("r1")
    assert [s.extras for s in steps] == [{"n": 0}]
    answer = await b.load_answer("r1")
    assert answer is not None and answer.body == b'{"id": "x"}'
    row = await b.load_rollout("r1")
    assert row is not None and (row.revision, row.steps, row.counters["num_turns"]) == (1, 1, 1)
    assert row.answer_key is not None and row.answer_key.fingerprint == b"\x01" * 16
    # A commit on a step count that is not the stored one writes nothing.
    with pytest.raises(TurnConflictError):
        await b.commit_turn("r1", _commit(0))
    assert await b.commit_turn("r1", _commit(1)) == 2
    assert len(await a.load_steps("r1", 1)) == 1


async def test_a_dead_gateways_turn_is_taken_over_and_its_late_commit_refused(
    server: RedisServer,
) -> None:
    prefix = f"t{next(_prefixes)}:"
    dead, alive = (Gateway(RedisStore(server.url, prefix=prefix, lease_s=0.3)) for _ in range(2))
    for gateway in (dead, alive):
        await gateway.open()
    try:
        await dead.create_rollout(_row())
        await dead.claim_turn("r1", "dead", 0.3)
        dead.leases._timers.pop("r1").cancel()  # stalled (SIGSTOP): nothing renews
        started = time.monotonic()
        await alive.claim_turn("r1", "alive", 0.3)
        assert time.monotonic() - started >= 0.15  # it waited for the lease to run out
        with pytest.raises(TurnConflictError, match="expired"):
            await dead.commit_turn("r1", _commit(0))
        assert await alive.commit_turn("r1", _commit(0)) == 1
        assert len(await alive.load_steps("r1")) == 1  # recorded once
    finally:
        for gateway in (dead, alive):
            await gateway.close()


async def test_a_lease_is_renewed_while_a_long_turn_runs(server: RedisServer) -> None:
    prefix = f"t{next(_prefixes)}:"
    a, b = (Gateway(RedisStore(server.url, prefix=prefix, lease_s=0.3)) for _ in range(2))
    for gateway in (a, b):
        await gateway.open()
    try:
        await a.create_rollout(_row())
        await a.claim_turn("r1", "a", 0.3)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.claim_turn("r1", "b", 0.3), 1.0)  # 3 leases long
        assert await a.commit_turn("r1", _commit(0)) == 1
    finally:
        for gateway in (a, b):
            await gateway.close()


async def test_cancel_and_delete_are_seen_by_every_gateway(gateways: list[Gateway]) -> None:
    a, b = gateways
    heard = b.heard
    await a.create_rollout(_row())
    assert await a.cancel_rollout("r1", {"status": "cancelled"}) == 1
    assert await b.save_rollout("r1", {"status": "completed"}) == 2
    row = await b.load_rollout("r1")
    assert row is not None and row.cancelled  # no later write clears it
    await a.save_exit({"rollout_id": "r1", "exit_code": 0, "seq": 1})
    assert await b.delete_rollout("r1")
    assert await a.load_rollout("r1") is None and await a.rollout_for_key("kd") is None
    assert (await reopened(a)).exits == []  # its exit report went with it
    await eventually(lambda: heard.removed == ["r1"])  # the other gateway drops its copy
    assert not await b.delete_rollout("r1")
    with pytest.raises(UnknownRolloutError):
        await a.claim_turn("r1", "a", 1.0)
    with pytest.raises(UnknownRolloutError):
        await a.save_rollout("r1", {})


async def test_a_gateway_whose_events_were_cut_is_told_it_missed_some(
    gateways: list[Gateway], server: RedisServer
) -> None:
    """Removals published while its channel was down never reach a gateway: after it
    subscribes again it is told to check what it holds."""
    import redis.asyncio as aioredis

    a, b = gateways
    await eventually(lambda: b.heard.missed == 1)  # (the first subscription)
    await a.create_rollout(_row())
    admin = aioredis.Redis.from_url(server.url)
    try:
        assert await admin.client_kill_filter(_type="pubsub") >= 2
    finally:
        await admin.aclose()
    assert await a.delete_rollout("r1")  # published while b is away
    await eventually(lambda: b.heard.missed == 2)


async def test_exit_reports_are_numbered_once_for_every_gateway(
    gateways: list[Gateway],
) -> None:
    a, b = gateways
    for rollout_id in ("r1", "r2", "r3"):
        await a.create_rollout(_row(rollout_id, key_digest=None))
    assert await a.report_exit(_exit("r1", 0)) == {"rollout_id": "r1", "exit_code": 0, "seq": 1}
    refused = {**_exit("r2", None), "refused": "max_turns"}
    assert await b.report_exit(refused) == {**refused, "seq": 2}  # (kept whole)
    with pytest.raises(UnknownRolloutError):
        await b.report_exit(_exit("unknown", 0))  # nothing kept, no number used
    # The store merges over the stored report, whatever the posting gateway heard of.
    assert await a.report_exit({**_exit("r2", 5), "started": True}) is None
    assert await a.report_exit({**_exit("r2", None), "refused": "other"}) is None
    assert (await a.report_exit(_exit("r1", 7)))["seq"] == 3  # (a later report of r1)
    seen = await b.exits_after(0)
    assert [(r["rollout_id"], r["exit_code"], r["seq"]) for r in seen] == [
        ("r1", 0, 1), ("r2", None, 2), ("r1", 7, 3),
    ]  # fmt: skip
    kept = await b.report_exit(_exit("r2", 1))  # the agent's exit after the refusal
    assert kept == {"rollout_id": "r2", "exit_code": 1, "seq": 4, "refused": "max_turns"}
    await a.report_exit(_exit("r3", 1))
    assert [r["seq"] for r in await b.exits_after(4)] == [5]
    # Every gateway's watcher hears every report, its own included, in order.
    for gateway in (a, b):
        heard = gateway.heard
        await eventually(lambda heard=heard: len(heard.exits) == 5)
        assert [r["seq"] for r in heard.exits] == [1, 2, 3, 4, 5]
    contents = await reopened(b)  # a gateway started now: each rollout's last report
    assert contents.exit_cursor == 5 and [r["seq"] for r in contents.exits] == [3, 4, 5]


async def test_policy_versions_only_move_forward(gateways: list[Gateway]) -> None:
    a, b = gateways
    heard = b.heard
    assert (await a.load_policy()).version is None
    assert (await a.announce_policy(3, 100.0)).version == 3
    assert (await b.announce_policy(2, 200.0)).version == 3  # older: refused
    state = await b.load_policy()
    assert (state.version, state.updated_at) == (3, 100.0)
    await eventually(lambda: 3 in heard.policies)  # gateway b hears of a's announcement


async def test_a_release_is_published_only_when_a_gateway_waits(
    gateways: list[Gateway], server: RedisServer
) -> None:
    import redis.asyncio as aioredis

    a, b = gateways
    await a.create_rollout(_row())
    listener = aioredis.Redis.from_url(server.url)
    pubsub = listener.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(a.channel)
    try:
        for _ in range(3):  # turns nobody waits for: no message at all
            await a.claim_turn("r1", "gw-a", 2.0)
            await a.release_turn("r1", "gw-a")
        assert await pubsub.get_message(timeout=0.2) is None
        await a.claim_turn("r1", "gw-a", 2.0)
        waiting = asyncio.ensure_future(b.claim_turn("r1", "gw-b", 2.0))
        await asyncio.sleep(0.1)
        await a.release_turn("r1", "gw-a")
        message = await pubsub.get_message(timeout=5)
        assert message is not None and message["data"] == b"w:r1"
        await asyncio.wait_for(waiting, 5)
    finally:
        await pubsub.aclose()
        await listener.aclose()


async def test_open_is_idempotent(server: RedisServer) -> None:
    """``serve`` opens the store before binding, on the loop that serves; the app's
    startup opens it again, and finds it open."""
    store = RedisStore(server.url, prefix=f"t{next(_prefixes)}:")
    contents = await store.open()
    assert await store.open() is contents
    await store.create_rollout(_row())
    await store.close()


async def test_a_full_redis_is_unavailable_not_an_error(gateways: list[Gateway]) -> None:
    a, _ = gateways
    await a._cmd("CONFIG", "SET", "maxmemory", "1")
    try:
        with pytest.raises(StoreUnavailableError, match="maxmemory"):
            await a.create_rollout(_row())
    finally:
        await a._cmd("CONFIG", "SET", "maxmemory", "0")
    await a.create_rollout(_row())


async def test_the_secret_is_shared_by_every_gateway(gateways: list[Gateway]) -> None:
    a, b = gateways
    assert a.secret == b.secret and len(a.secret) == 32


async def test_state_of_another_layout_is_refused(gateways: list[Gateway]) -> None:
    a, _ = gateways
    await a._cmd("HSET", f"{a.prefix}meta", "layout", 99)
    with pytest.raises(StoreVersionError, match="layout 99"):
        await reopened(a)
    await a._cmd("HSET", f"{a.prefix}meta", "layout", LAYOUT)
    await a._cmd("HSET", f"{a.prefix}r:old", "reg", "{}", "v", "0")
    with pytest.raises(StoreVersionError, match="rollout old"):
        await a.load_rollout("old")


async def test_an_unreachable_redis_is_unavailable_not_a_hang() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    with pytest.raises(StoreUnavailableError, match="redis at 127.0.0.1"):
        await store.open()
    await store.close()


class CountingStore(RedisStore):
    """A gateway's store counting the round trips it makes to Redis."""

    round_trips = 0

    async def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        self.round_trips += 1
        return await super().run(name, keys, args)

    async def _cmd(self, *command: Any) -> Any:
        self.round_trips += 1
        return await super()._cmd(*command)


async def test_a_turn_after_another_gateways_is_two_round_trips(server: RedisServer) -> None:
    """Gateways taking turns: the claim returns what the other gateway recorded (its row
    and steps, read along) and the commit ends the claim (the release that follows asks
    Redis nothing)."""
    prefix = f"t{next(_prefixes)}:"
    # (A long lease: no renewal, a round trip of its own, on a slow machine.)
    a, b = (Gateway(CountingStore(server.url, prefix=prefix, lease_s=120)) for _ in range(2))
    for gateway in (a, b):
        await gateway.open()
    await a.create_rollout(_row())
    held = {a: HeldCopy(-1, 0), b: HeldCopy(-1, 0)}

    async def turn(gateway: Gateway, owner: str, index: int) -> None:
        claim = await gateway.claim("r1", owner, 120.0, held[gateway])
        if index > 0:  # another gateway recorded the last turn: this copy is behind
            assert claim.row is not None and claim.row.revision == claim.revision
            assert claim.steps is not None
            assert len(claim.steps) == index - held[gateway].steps
        commit = _commit(index)
        commit.releases, commit.delivered = owner, True
        revision = await gateway.commit_turn("r1", commit)
        held[gateway] = HeldCopy(revision, index + 1)
        await gateway.release_turn("r1", owner, delivered=True)  # ended by the commit

    try:
        await turn(a, "gw-a", 0)
        await turn(b, "gw-b", 1)  # b reads a's row and step along with its claim
        before = a.round_trips + b.round_trips
        await turn(a, "gw-a", 2)
        await turn(b, "gw-b", 3)
        assert a.round_trips + b.round_trips - before == 4  # two per turn
        assert [s.extras for s in await a.load_steps("r1")] == [{"n": i} for i in range(4)]
        row = await b.load_rollout("r1")
        assert row is not None and row.answer_key is not None and row.answer_key.delivered
        assert await b._cmd("EXISTS", f"{prefix}lease:r1") == 0  # the commit released it
    finally:
        for gateway in (a, b):
            await gateway.close()


async def test_the_last_steps_check_state_is_read_along_by_the_next_claim(
    gateways: list[Gateway],
) -> None:
    """What the recording gateway checks the next turn against reaches the gateway that
    takes it, with the step; a damaged or out-of-date one is dropped, never trusted."""
    a, b = gateways
    await a.create_rollout(_row())
    check = CheckState((b"\x02" * 16, 120, 3), (b"\x03" * 16, 900, 2))

    async def committed(index: int, step_check: CheckState | None) -> None:
        await a.claim_turn("r1", "gw-a", 2.0)
        commit = _commit(index)
        commit.step.check = step_check
        commit.releases = "gw-a"
        await a.commit_turn("r1", commit)

    held = HeldCopy(-1, 0)

    async def read_by_b() -> list[Any]:
        nonlocal held
        claim = await b.claim("r1", "gw-b", 2.0, held)
        assert claim.row is not None and claim.steps is not None
        held = HeldCopy(claim.revision, claim.row.steps)
        await b.release_turn("r1", "gw-b")
        return [step.check for step in claim.steps]

    await committed(0, None)
    await committed(1, check)
    assert await read_by_b() == [None, check]  # only the last step's is kept
    await committed(2, check)
    await a._cmd("HSET", f"{a.prefix}r:r1", "chk", b"damaged")
    assert await read_by_b() == [None]
    await committed(3, check)
    stale = await a._cmd("HGET", f"{a.prefix}r:r1", "chk")
    await committed(4, None)  # a step without one leaves none, not the one before
    await a._cmd("HSET", f"{a.prefix}r:r1", "chk", stale)  # step 3's, beside step 4
    assert await read_by_b() == [None, None]


async def test_scripts_redis_forgot_are_loaded_again(gateways: list[Gateway]) -> None:
    a, b = gateways
    await a.create_rollout(_row())
    await a._cmd("SCRIPT", "FLUSH")  # as a restarted Redis forgets them
    assert await b.claim_turn("r1", "gw-b", 2.0) == 0
    await b.release_turn("r1", "gw-b")


async def test_commands_issued_together_go_in_one_pipeline_each_with_its_own_reply(
    server: RedisServer,
) -> None:
    """Concurrent turns' commands are sent to Redis together, yet each gets its own reply
    or its own error, in the order issued, as if sent alone."""
    from rollout_gateway.server.state.redis_backend.batches import CommandBatches
    from rollout_gateway.server.state.redis_backend.connection import RedisConnection

    sizes: list[int] = []

    class Counted(CommandBatches):
        async def _send(self, batch: Any) -> None:
            sizes.append(len(batch))
            await super()._send(batch)

    connection = RedisConnection(server.url, timeout_s=5.0)
    connection._batches = Counted(lambda: connection.client)
    prefix = f"t{next(_prefixes)}:"
    try:
        await connection.cmd("SET", f"{prefix}text", "x")
        replies = await asyncio.gather(
            *(connection.cmd("INCR", f"{prefix}n") for _ in range(5)),
            connection.cmd("INCR", f"{prefix}text"),  # not a number: this one fails alone
            connection.cmd("GET", f"{prefix}n"),
            return_exceptions=True,
        )
        assert replies[:5] == [1, 2, 3, 4, 5]
        assert isinstance(replies[5], Exception) and "not an integer" in str(replies[5])
        assert replies[6] == b"5"
        assert sizes == [1, 7]  # the SET alone; the seven issued together in one pipeline
    finally:
        await connection.aclose()


async def test_a_command_whose_caller_gave_up_before_it_was_sent_is_not_sent(
    server: RedisServer,
) -> None:
    from rollout_gateway.server.state.redis_backend.connection import RedisConnection

    connection = RedisConnection(server.url, timeout_s=5.0)
    key = f"t{next(_prefixes)}:n"
    try:
        waiting = asyncio.ensure_future(connection.cmd("INCR", key))
        await asyncio.sleep(0)  # issued, not sent yet
        waiting.cancel()
        assert await connection.cmd("INCR", key) == 1
    finally:
        await connection.aclose()


async def test_connections_idle_across_a_redis_restart_are_reconnected_not_failed(
    server: RedisServer,
) -> None:
    """A restarted Redis closed every pooled connection while it sat idle: the next
    commands, alone and in a pipeline, reconnect and succeed instead of failing once per
    connection (each such failure was a 503 to an agent)."""
    from rollout_gateway.server.state.redis_backend.connection import RedisConnection

    connection = RedisConnection(server.url, timeout_s=5.0)
    key = f"t{next(_prefixes)}:n"
    try:
        # Three connections in the pool: three commands in flight at once.
        await asyncio.gather(*(connection.client.execute_command("PING") for _ in range(3)))
        assert len(connection.client.connection_pool._available_connections) == 3
        server.kill()
        server.restart()
        await asyncio.sleep(0.1)  # the event loop reads each closed connection's end
        assert await connection.cmd("INCR", key) == 1
        replies = await asyncio.gather(*(connection.cmd("INCR", key) for _ in range(4)))
        assert replies == [2, 3, 4, 5]
        direct = [connection.client.execute_command("INCR", key) for _ in range(3)]
        assert sorted(await asyncio.gather(*direct)) == [6, 7, 8]
    finally:
        await connection.aclose()
