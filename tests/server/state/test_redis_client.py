"""The Redis backend's atomic steps against a real Redis: claims, commits, leases, exits,
policy versions, layout checks and an unreachable server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollout_gateway.local_cluster import RedisServer, free_port

from .redis_fixtures import redis_server

pytest.importorskip("redis")

from rollout_gateway.server.state.redis_backend.client import (  # noqa: E402
    SCHEMA,
    RedisState,
    StateVersionError,
    StoreUnavailable,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from redis_server(tmp_path_factory.mktemp("redis"))


_prefixes = iter(range(1_000_000))


@pytest.fixture
async def state(server: RedisServer) -> AsyncIterator[RedisState]:
    # A prefix per test: the tests share one server, never each other's keys.
    s = RedisState.from_url(server.url, prefix=f"t{next(_prefixes)}:", lease_ms=2000, ttl_ms=60_000)
    await s.open()
    yield s
    await s.aclose()


async def _claim(state: RedisState, owner: str, fp: bytes = b"fp1", idem: str | None = None,
                 held: int = 0, retry: bool = False):  # fmt: skip
    return await state.claim(
        "r1", owner, fp, idem, held=held, window_ms=120_000, is_retry=retry
    )


async def test_one_turn_at_a_time_and_a_retry_gets_the_answer(state: RedisState) -> None:
    assert await state.create("r1", b'{"model": "m"}', b"{}", "keydigest")
    assert not await state.create("r1", b"{}", b"{}", None)  # registered already
    assert await state.rollout_for_key("keydigest") == "r1"
    first = await _claim(state, "gw-a")
    assert (first.outcome, first.ver, first.events) == ("claimed", 0, [])
    assert (await _claim(state, "gw-b")).outcome == "running"  # the same body: same turn
    assert (await _claim(state, "gw-b", fp=b"other")).outcome == "busy"
    outcome = await state.commit(
        "r1", "gw-a", 0, b'{"num_turns": 1}', [b"step0"], answer=b"ANSWER", fingerprint=b"fp1",
        delivered=False,
    )  # fmt: skip
    assert outcome == ("ok", 1)
    # The racing retry now gets the original's answer, not a second turn.
    retry = await _claim(state, "gw-b")
    assert (retry.outcome, retry.answer) == ("answered", b"ANSWER")
    # Once delivered, the same body without retry marks is a new turn; with them, a replay.
    await state.delivered("r1", b"fp1", None)
    assert (await _claim(state, "gw-b", retry=True)).outcome == "answered"
    second = await _claim(state, "gw-b", held=0)
    assert (second.outcome, second.ver, second.counters) == ("claimed", 1, b'{"num_turns": 1}')
    assert second.events == [b"step0"]  # what gw-b's cache lacked


async def test_idempotency_keys_decide_when_both_sides_carry_one(state: RedisState) -> None:
    await state.create("r1", b"{}", b"{}", None)
    assert (await _claim(state, "a", fp=b"x", idem="k1")).outcome == "claimed"
    assert (await _claim(state, "b", fp=b"y", idem="k1")).outcome == "running"
    assert (await _claim(state, "b", fp=b"x", idem="k2")).outcome == "busy"
    await state.commit("r1", "a", 0, b"{}", [b"s"], answer=b"A", fingerprint=b"x",
                       idempotency_key="k1", delivered=True)  # fmt: skip
    assert (await _claim(state, "b", fp=b"z", idem="k1")).answer == b"A"


async def test_a_commit_needs_the_lease_and_the_version_it_claimed(state: RedisState) -> None:
    await state.create("r1", b"{}", b"{}", None)
    await _claim(state, "a")
    assert (await state.commit("r1", "b", 0, b"{}", [b"s"]))[0] == "lost"  # not b's lease
    assert (await state.commit("r1", "a", 5, b"{}", [b"s"]))[0] == "stale"
    assert await state.commit("r1", "a", 0, b"{}", [b"s"]) == ("ok", 1)
    assert (await state.commit("r1", "a", 1, b"{}", [b"s"]))[0] == "lost"  # released
    assert (await state.load("r1"))[1] == [b"s"]  # type: ignore[index]  # recorded once


async def test_an_expired_lease_is_taken_over_and_the_late_owner_cannot_commit(
    server: RedisServer,
) -> None:
    state = RedisState.from_url(server.url, prefix="lease:", lease_ms=200, ttl_ms=60_000)
    await state.open()
    try:
        await state.create("r1", b"{}", b"{}", None)
        await _claim(state, "dead")
        assert (await _claim(state, "b")).outcome == "running"
        assert await state.renew("r1", "dead")
        await asyncio.sleep(0.4)  # the owner died: its lease ran out
        assert (await _claim(state, "b")).outcome == "claimed"
        assert not await state.renew("r1", "dead")
        assert (await state.commit("r1", "dead", 0, b"{}", [b"s"]))[0] == "lost"
        assert await state.commit("r1", "b", 0, b"{}", [b"s"]) == ("ok", 1)
    finally:
        await state.aclose()


async def test_removed_and_cancelled_rollouts(state: RedisState) -> None:
    await state.create("r1", b"{}", b'{"status": "active"}', "kd")
    assert await state.cancel("r1")
    assert (await _claim(state, "a")).cancelled
    assert await state.delete("r1", "kd") == b'{"status": "active"}'
    assert await state.rollout_for_key("kd") is None
    assert (await _claim(state, "a")).outcome == "gone"
    assert await state.delete("r1", "kd") is None
    assert not await state.cancel("r1")


async def test_exit_reports_are_numbered_once_for_every_gateway(state: RedisState) -> None:
    other = RedisState.from_url(_url(state), prefix=state.prefix, lease_ms=1000, ttl_ms=1000)
    await other.open()
    try:
        assert await state.report_exit("r1", 0) == 1
        assert await other.report_exit("r2", None) == 2
        entries = await other.read_exits(b"0-0", None)
        assert [(e[1][b"rid"], e[1][b"code"]) for e in entries] == [(b"r1", b"0"), (b"r2", b"")]
        waiter = asyncio.ensure_future(state.read_exits(entries[-1][0], 5000))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await other.report_exit("r3", 1)
        assert [e[1][b"rid"] for e in await waiter] == [b"r3"]
    finally:
        await other.aclose()


def _url(state: RedisState) -> str:
    kw = state.client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


async def test_policy_versions_only_move_forward(state: RedisState) -> None:
    assert await state.policy() == (None, None, 0)
    accepted, version, at, epoch = await state.announce_policy(3)
    assert (accepted, version, epoch) == (True, 3, 1) and at is not None
    assert (await state.announce_policy(3))[3] == 1  # the same one again: no new epoch
    assert (await state.announce_policy(2))[:2] == (False, 3)
    assert (await state.policy())[0::2] == (3, 1)


async def test_state_of_another_layout_is_refused(state: RedisState) -> None:
    await state.call("HSET", f"{state.prefix}meta", "schema", SCHEMA + 1)
    with pytest.raises(StateVersionError, match="layout"):
        await state.open()
    await state.call("HSET", f"{state.prefix}meta", "schema", SCHEMA)
    await state.call("HSET", f"{state.prefix}r:old", "reg", json.dumps({}), "v", "0")
    with pytest.raises(StateVersionError, match="rollout old"):
        await state.load("old")


async def test_an_unreachable_redis_is_store_unavailable(tmp_path: Path) -> None:
    state = RedisState.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0,
                                lease_ms=1000, ttl_ms=1000)  # fmt: skip
    with pytest.raises(StoreUnavailable):
        await state.open()
    await state.aclose()


async def test_the_secret_is_shared_by_every_gateway(state: RedisState) -> None:
    other = RedisState.from_url(_url(state), prefix=state.prefix, lease_ms=1000, ttl_ms=1000)
    await other.open()
    assert other.secret == state.secret and len(state.secret) == 32
    await other.aclose()
