"""Several gateways on one shared store: any turn of a rollout may land on any gateway,
round robin with no stickiness.

The gateways run in this process on ``SharedMemoryStore`` and on a real Redis
(``RedisStore``, one per gateway, on one ``redis-server``): trajectories equal one
gateway's; a retry sent to another gateway while its original runs gets the original's
answer (no second engine call); cancel, unregister, exit reports and policy versions at
one gateway hold at the others. (Separate gateway processes behind HAProxy, killed with
``kill -9``: ``tests/test_scaleout.py``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
from support.shared_memory import SharedMemoryStore, coordination
from support.waiting import eventually

from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.state.ledger import RolloutLedger, TurnUse
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.registry import RolloutRecord, RolloutRegistry
from rollout_gateway.server.state.store import RolloutStore
from rollout_gateway.server.state.stored import StoredRollouts

from ..conftest import ADMIN_TOKEN, UPSTREAM, RecordingUpstream, script

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
_prefixes = itertools.count()

#: Makes each gateway's handle on one shared store.
Shared = Callable[[], RolloutStore]


@pytest.fixture(params=["memory", "redis"])
def shared(request: pytest.FixtureRequest) -> Shared:
    """One shared store, as each gateway's handle: the shared memory store (one object
    for all), or a RedisStore per gateway on one Redis under a prefix of this test."""
    if request.param == "memory":
        store = SharedMemoryStore()
        return lambda: store
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed (the redis extra)")
    from rollout_gateway.server.state.redis_backend.store import RedisStore

    from .redis_fixtures import shared_redis_url

    url, prefix = shared_redis_url(), f"gateways{next(_prefixes)}:"
    return lambda: RedisStore(url, prefix=prefix)


STEPS = [{"tool": "run", "arguments": {"cmd": f"step {i}"}} for i in range(4)] + [{"say": "done"}]


@contextlib.asynccontextmanager
async def gateways(upstream: Any, store: Any, count: int) -> AsyncIterator[list[httpx.AsyncClient]]:
    """``count`` gateways on ``store`` (a store, or a maker of each gateway's handle)."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(count):
            config = GatewayConfig(upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN)
            handle = store() if callable(store) else store
            transport = httpx.ASGITransport(upstream)
            app = create_app(
                config, upstream_transport=transport, store=handle, coordinator=coordination(handle)
            )
            await stack.enter_async_context(app.router.lifespan_context(app))
            clients.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")
                )
            )
        yield clients


async def run_rollout(clients: list[httpx.AsyncClient], rollout_id: str) -> dict[str, Any]:
    """Register at the first gateway, then send turn ``i`` to gateway ``i % n``."""
    r = await clients[0].post(
        f"/v1/rollouts/{rollout_id}/register", json={"model": "m"}, headers=ADMIN
    )
    key = r.json()["api_key"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": script(*STEPS)}]
    for turn in range(len(STEPS)):
        client = clients[turn % len(clients)]
        r = await client.post(
            "/v1/chat/completions",  # routed by the key: any gateway finds the rollout
            json={"model": "m", "messages": messages},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
    trajectory = await clients[-1].get(f"/v1/rollouts/{rollout_id}/trajectory", headers=ADMIN)
    return dict(trajectory.json())


def comparable(trajectory: dict[str, Any]) -> list[Any]:
    return [
        (s["prompt"], s["completion"], s["tokens"], s["is_truncated"])
        for s in trajectory["trajectory"]
    ]


async def test_round_robin_turns_record_one_gateways_trajectory(shared: Shared) -> None:
    upstream = RecordingUpstream().app()
    async with gateways(upstream, MemoryStore(), 1) as one:
        alone = await run_rollout(one, "r1")
    async with gateways(upstream, shared, 3) as three:
        shared = await run_rollout(three, "r1")
        assert shared["num_turns"] == len(STEPS)
        assert comparable(shared) == comparable(alone)
        # Every gateway serves the whole trajectory.
        for client in three:
            r = await client.get("/v1/rollouts/r1/trajectory", headers=ADMIN)
            assert comparable(r.json()) == comparable(alone)


async def test_a_retry_at_another_gateway_gets_the_originals_answer(shared: Shared) -> None:
    upstream = RecordingUpstream(latency_s=0.3)
    async with gateways(upstream.app(), shared, 2) as (a, b):
        r = await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": script({"say": "hi"})}]}
        url = "/v1/rollouts/r1/chat/completions"
        original = asyncio.ensure_future(a.post(url, json=body, headers=key))
        await asyncio.sleep(0.1)  # the original runs at a
        retry = await b.post(url, json=body, headers={**key, "x-stainless-retry-count": "1"})
        first = await original
        assert first.status_code == retry.status_code == 200
        assert retry.json() == first.json()  # the same completion id: not sampled again
        assert len(upstream.requests) == 1
        trajectory = (await b.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert trajectory["num_turns"] == 1


async def test_cancel_and_unregister_at_one_gateway_hold_at_the_others(shared: Shared) -> None:
    async with gateways(RecordingUpstream().app(), shared, 2) as (a, b):
        r = await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": script({"say": "hi"})}]}
        url = "/v1/rollouts/r1/chat/completions"
        assert (await b.post(url, json=body, headers=key)).status_code == 200
        assert (await a.post("/v1/rollouts/r1/cancel", headers=ADMIN)).status_code == 200
        body["messages"] += [
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "x"},
        ]
        refused = await b.post(url, json=body, headers=key)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "rollout_cancelled"
        assert (await b.post("/v1/rollouts/r1/unregister", headers=ADMIN)).status_code == 200
        gone = await a.post(url, json=body, headers=key)
        assert gone.status_code == 404
        assert (await a.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).status_code == 404


async def test_a_removal_missed_while_a_gateways_events_were_cut_still_drops_its_copy() -> None:
    """The events channel is cut (Redis restarted, a network blip) while another gateway
    unregisters a rollout: the gateway holding a copy drops it once it listens again, not
    after the rollout's idle TTL (``/health`` would count it, the registry hold it)."""
    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed (the redis extra)")
    import redis.asyncio as aioredis

    from rollout_gateway.server.state.redis_backend.store import RedisStore

    from .redis_fixtures import shared_redis_url

    url, prefix = shared_redis_url(), f"gateways{next(_prefixes)}:"
    async with gateways(RecordingUpstream().app(), lambda: RedisStore(url, prefix=prefix), 2) as (
        a,
        b,
    ):
        r = await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": script({"say": "hi"})}]}
        assert (await b.post("/v1/chat/completions", json=body, headers=key)).status_code == 200
        assert (await b.get("/health")).json()["active_rollouts"] == 1  # b holds a copy
        admin = aioredis.Redis.from_url(url)
        try:
            await admin.client_kill_filter(_type="pubsub")  # every gateway's channel
        finally:
            await admin.aclose()
        assert (await a.post("/v1/rollouts/r1/unregister", headers=ADMIN)).status_code == 200

        async def dropped_at_b() -> bool:
            return bool((await b.get("/health")).json()["active_rollouts"] == 0)

        await eventually(dropped_at_b)
        assert (await b.post("/v1/chat/completions", json=body, headers=key)).status_code == 401


@pytest.mark.parametrize("count", [2])
async def test_registering_one_id_twice_across_gateways_is_a_conflict(
    count: int, shared: Shared
) -> None:
    async with gateways(RecordingUpstream().app(), shared, count) as (a, b):
        assert (
            await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        ).status_code == 200
        r = await b.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        assert r.status_code == 409


async def test_exit_reports_are_numbered_once_and_seen_at_every_gateway(shared: Shared) -> None:
    async with gateways(RecordingUpstream().app(), shared, 3) as (a, b, c):
        keys = []
        for rollout_id in ("r1", "r2"):
            r = await a.post(
                f"/v1/rollouts/{rollout_id}/register", json={"model": "m"}, headers=ADMIN
            )
            keys.append({"Authorization": f"Bearer {r.json()['api_key']}"})
        # A long-poll at c waits for the report an agent posts at b.
        waiting = asyncio.ensure_future(
            c.get("/v1/rollouts/exits?after=0&timeout=10", headers=ADMIN)
        )
        await asyncio.sleep(0.05)
        assert (
            await b.post("/v1/rollouts/r1/exit", json={"exit_code": 3}, headers=keys[0])
        ).status_code == 200
        first = (await asyncio.wait_for(waiting, 10)).json()
        assert first == {"exits": [{"rollout_id": "r1", "exit_code": 3, "seq": 1}], "cursor": 1}
        assert (
            await a.post("/v1/rollouts/r2/exit", json={"exit_code": 0}, headers=keys[1])
        ).status_code == 200
        # One numbering: every gateway answers the same reports for the same cursor.
        for client in (a, b, c):
            answer = await client.get("/v1/rollouts/exits?after=1&timeout=10", headers=ADMIN)
            answer = answer.json()
            assert answer == {
                "exits": [{"rollout_id": "r2", "exit_code": 0, "seq": 2}],
                "cursor": 2,
            }
        # Unregistered at one gateway: its report is gone at all of them.
        assert (await c.post("/v1/rollouts/r1/unregister", headers=ADMIN)).status_code == 200
        for client in (a, b, c):

            async def only_r2(client: httpx.AsyncClient = client) -> bool:
                answer = (await client.get("/v1/rollouts/exits?after=0", headers=ADMIN)).json()
                return [r["rollout_id"] for r in answer["exits"]] == ["r2"]

            await eventually(only_r2)
            # Each gateway pins the rollouts it holds (read back or registered) to its upstream.
            health = (await client.get("/health", headers=ADMIN)).json()
            assert health["upstreams"][0]["pinned"] == health["active_rollouts"]


async def test_a_cursor_another_gateway_gave_is_not_taken_for_a_restart() -> None:
    from rollout_gateway.exits import ExitBoard

    published: list[Any] = []
    board = ExitBoard(publish=published.append)
    board.report("r0", 1)  # numbered by the store: handed over, not held yet
    assert published == [{"rollout_id": "r0", "exit_code": 1, "seq": 0}]
    assert board.since(0) == {"exits": [], "cursor": 0}
    board.apply({"rollout_id": "r1", "exit_code": 0, "seq": 1})
    # The env saw report 3 at another gateway; this board has not heard of 2 and 3 yet.
    assert board.since(3) == {"exits": [], "cursor": 3}
    board.apply({"rollout_id": "r3", "exit_code": 0, "seq": 3})
    board.apply({"rollout_id": "r2", "exit_code": 1, "seq": 2})  # heard late
    board.apply({"rollout_id": "r2", "exit_code": 1, "seq": 2})  # heard twice
    assert [r["seq"] for r in board.since(1)["exits"]] == [2, 3]
    assert board.since(2) == {
        "exits": [{"rollout_id": "r3", "exit_code": 0, "seq": 3}],
        "cursor": 3,
    }


async def test_a_policy_version_announced_at_one_gateway_stamps_turns_at_the_others(
    shared: Shared,
) -> None:
    async with gateways(RecordingUpstream().app(), shared, 3) as (a, b, c):
        assert (
            await a.post("/v1/policy/version", json={"version": 7}, headers=ADMIN)
        ).status_code == 200
        assert (await b.get("/v1/policy/version", headers=ADMIN)).json()["version"] == 7
        stale = await b.post("/v1/policy/version", json={"version": 6}, headers=ADMIN)
        assert stale.status_code == 409
        r = await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": script({"say": "hi"})}]}
        assert (
            await a.post("/v1/policy/version", json={"version": 8}, headers=ADMIN)
        ).status_code == 200
        # At once at a gateway that was not asked: its turn is stamped with the new version.
        assert (
            await c.post("/v1/rollouts/r1/chat/completions", json=body, headers=key)
        ).status_code == 200
        trajectory = (await a.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert trajectory["trajectory"][0]["extras"]["policy_version"] == 8


class CountingStore(SharedMemoryStore):
    """The shared memory store, counting the steps each gateway reads back."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_read = 0

    async def load_steps(self, rollout_id: str, start: int = 0) -> Any:
        steps = await super().load_steps(rollout_id, start)
        self.steps_read += len(steps)
        return steps


async def test_a_gateway_catches_up_with_only_the_steps_stored_since_its_copy() -> None:
    store = CountingStore()
    async with gateways(RecordingUpstream().app(), store, 2) as clients:
        await run_rollout(clients, "r1")
    # Turn i at gateway i % 2 reads the one step the other gateway recorded since its
    # last turn, and so does the trajectory read at the end: each step is read back once,
    # by the gateway that did not record it (reloading whole copies would read 15).
    assert store.steps_read == len(STEPS)


async def test_catching_up_step_by_step_records_what_one_copy_recorded() -> None:
    """A gateway's copy brought up to date turn by turn (the other gateway recording one
    step at a time, abandoning one of its answers once this copy held it) holds the
    recording gateway's trajectory, ids and branches included."""
    store = SharedMemoryStore()
    writer, reader = (
        StoredRollouts(
            RolloutRegistry(max_rollouts=10, ttl_s=60), store, coordination(store), owner=name,
            lease_s=10, retry_window_s=60,
        )
        for name in ("writer", "reader")
    )  # fmt: skip
    ledger = RolloutLedger(store, owner="writer", wall_clock=time.time)
    record = RolloutRecord("r1", "m", {}, 10, None, UPSTREAM, last_activity=0.0)
    await writer.register(record)
    copy = await reader.find("r1")
    assert copy is not None
    sys_user = [{"role": "user", "content": "task"}]
    history = list(sys_user)
    for turn in range(4):
        await writer.claim(record)
        if turn == 3:  # the answer of turn 2 reached nobody; the reader holds that step
            await ledger.abandon_last(record)
            history = history[:-1]
        answer = {"role": "assistant", "content": f"a{turn}"}
        prompt = list(range(1, 3 + 2 * turn))
        record.recorder.record(
            history, [answer], prompt_ids=prompt, completion_ids=[100 + turn],
            completion_logprobs=[-0.5],
        )  # fmt: skip
        await ledger.count_turn(record, TurnUse(message_bytes=0, completion_tokens=1), None)
        await writer.release(record)
        history = [*history, answer]
        await reader.claim(copy)  # catches up
        await reader.release(copy)
        assert copy.recorder.steps() == record.recorder.steps()
        assert copy.recorder.overview() == record.recorder.overview()
    assert copy.recorder.abandoned_indexes() == [2]


async def forget_delivery(store: RolloutStore, rollout_id: str) -> None:
    """Make the stored last answer undelivered, as a gateway that committed it and died
    before handing it out leaves it."""
    if isinstance(store, MemoryStore):
        answer = store._rollouts[rollout_id].answer
        assert answer is not None
        answer.key = replace(answer.key, delivered=False)
    else:
        await store._cmd("HSET", f"{store.prefix}r:{rollout_id}", "a_dlv", "0")  # type: ignore[attr-defined]


async def test_an_answer_a_dead_gateway_never_handed_out_is_a_lost_answer_elsewhere(
    shared: Shared,
) -> None:
    """What one gateway does with an answer its agent never got, the others do too: an
    unmarked repeat of the request gets that answer (not a second sample), and a request
    that moved on without it takes it back (abandoned, not a turn the agent saw)."""
    upstream = RecordingUpstream()
    async with gateways(upstream.app(), shared, 2) as (a, b):
        r = await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        url = "/v1/rollouts/r1/chat/completions"
        task = [{"role": "user", "content": script({"say": "one"}, {"say": "two"})}]
        first = await a.post(url, json={"model": "m", "messages": task}, headers=key)
        store = a._transport.app.state.gateway.store  # type: ignore[attr-defined]
        await forget_delivery(store, "r1")  # gateway a "died" before its answer went out
        again = await b.post(url, json={"model": "m", "messages": task}, headers=key)
        assert again.json() == first.json() and len(upstream.requests) == 1
        await forget_delivery(store, "r1")  # ... and once more
        moved_on = [*task, {"role": "user", "content": "still there?"}]
        r = await b.post(url, json={"model": "m", "messages": moved_on}, headers=key)
        assert r.status_code == 200 and len(upstream.requests) == 2
        trajectory = (await a.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert trajectory["num_turns"] == 1  # the answer nobody got is not a turn
        assert [s["prompt"][-1]["content"] for s in trajectory["trajectory"]] == ["still there?"]


async def test_a_rollout_idle_at_one_gateway_but_busy_at_another_is_not_deleted() -> None:
    from ..conftest import FakeClock

    store = SharedMemoryStore()
    upstream = httpx.ASGITransport(RecordingUpstream().app())
    clock = FakeClock()
    config = GatewayConfig.from_fields(
        upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN, rollout_ttl_s=60
    )
    idle = create_app(
        config,
        upstream_transport=upstream,
        store=store,
        coordinator=coordination(store),
        clock=clock,
    )
    async with idle.router.lifespan_context(idle):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(idle), base_url="http://gw"
        ) as a:
            await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
            clock.advance(61)  # idle here...
            gateway: Any = idle.state.gateway
            # ...but another gateway served it just now.
            row = await store.load_rollout("r1")
            assert row is not None
            await store.save_rollout(
                "r1", {**row.counters, "updated_at": gateway.rollouts.wall_clock()}
            )
            assert gateway.sweep() == 1  # dropped from this gateway's cache...
            await gateway.rollouts.drain()
            assert await store.load_rollout("r1") is not None  # ...not from the store
            r = await a.get("/v1/rollouts/r1/trajectory", headers=ADMIN)
            assert r.status_code == 200  # found again at the store
            clock.advance(61)  # and now idle at every gateway: gone from the store too
            assert gateway.sweep() == 1
            await gateway.rollouts.drain()
            assert await store.load_rollout("r1") is None


async def test_a_turn_refused_at_one_gateway_is_on_every_gateways_exit_channel(
    shared: Shared,
) -> None:
    async with gateways(RecordingUpstream().app(), shared, 3) as (a, b, c):
        r = await a.post(
            "/v1/rollouts/r1/register", json={"model": "m", "max_turns": 1}, headers=ADMIN
        )
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        url = "/v1/rollouts/r1/chat/completions"
        task = [{"role": "user", "content": script({"say": "one"}, {"say": "two"})}]
        first = await a.post(url, json={"model": "m", "messages": task}, headers=key)
        assert first.status_code == 200
        more = [*task, first.json()["choices"][0]["message"], {"role": "user", "content": "x"}]
        refused = await b.post(url, json={"model": "m", "messages": more}, headers=key)
        assert refused.status_code >= 400
        code = refused.json()["error"]["code"]
        # The env's long-poll at a third gateway hears it (the agent may retry for long).
        answer = (await c.get("/v1/rollouts/exits?after=0&timeout=10", headers=ADMIN)).json()
        assert [(r["rollout_id"], r.get("refused")) for r in answer["exits"]] == [("r1", code)]
        # The agent's own exit report later keeps the refusal on the rollout's report.
        posted = await a.post("/v1/rollouts/r1/exit", json={"exit_code": 0}, headers=key)
        assert posted.status_code == 200

        async def kept() -> bool:
            answer = (await c.get("/v1/rollouts/exits?after=1", headers=ADMIN)).json()
            return [r.get("refused") for r in answer["exits"]] == [code]

        await eventually(kept)


async def run_rewriting_rollout(clients: list[httpx.AsyncClient]) -> dict[str, Any]:
    """Turn ``i`` at gateway ``i % n``; the fourth request rewrites a tool output the
    second one sent (the previous turn was another gateway's)."""
    r = await clients[0].post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
    key = {"Authorization": f"Bearer {r.json()['api_key']}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": script(*STEPS)}]
    for turn in range(len(STEPS)):
        if turn == 3:
            messages[2] = {**messages[2], "content": "rewritten"}
        client = clients[turn % len(clients)]
        body = {"model": "m", "messages": messages}
        r = await client.post("/v1/chat/completions", json=body, headers=key)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
    return dict((await clients[-1].get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json())


async def test_a_rewritten_history_is_caught_after_another_gateways_turn(shared: Shared) -> None:
    """The gateway taking a turn after another gateway's checks the request against the
    digests that gateway stored with its step: a request that rewrites an earlier message
    is still recorded as a rewritten history, as one gateway records it."""
    upstream = RecordingUpstream().app()
    async with gateways(upstream, MemoryStore(), 1) as one:
        alone = await run_rewriting_rollout(one)
    async with gateways(upstream, shared, 3) as three:
        spread = await run_rewriting_rollout(three)
    assert comparable(spread) == comparable(alone)
    flags = [s["extras"].get("history_rewritten", False) for s in spread["trajectory"]]
    assert flags == [False, False, False, True, False]
