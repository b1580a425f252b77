"""Idle expiry, registry bound, and concurrency (serialised turns, independent rollouts)."""

from __future__ import annotations

import asyncio

from support.waiting import eventually

from ..conftest import FakeClock, GatewayHarness, RecordingUpstream, script

MESSAGES = [{"role": "user", "content": script({"say": "hi"})}]


async def test_idle_rollouts_expire_in_the_sweep(make_gateway) -> None:
    clock = FakeClock()
    gw = await make_gateway(clock=clock, rollout_ttl_s=60)
    await gw.register("idle")
    await gw.register("busy")
    clock.advance(45)
    assert (await gw.chat("busy", MESSAGES)).status_code == 200  # activity resets its TTL
    clock.advance(30)  # idle: 75 s > 60; busy: 30 s
    assert gw.gateway.sweep() == 1
    assert (await gw.trajectory("idle")).status_code == 404
    assert (await gw.trajectory("busy")).status_code == 200
    assert gw.gateway.pool.upstreams[0].pinned == 1  # the expired pin was released
    assert "rollout_gateway_expired_rollouts_total 1" in (await gw.client.get("/metrics")).text


async def test_expired_rollout_is_gone_even_before_the_sweep(make_gateway) -> None:
    clock = FakeClock()
    gw = await make_gateway(clock=clock, rollout_ttl_s=10)
    await gw.register("r1")
    clock.advance(11)
    assert (await gw.chat("r1", MESSAGES)).status_code == 404
    assert (await gw.register("r1")).status_code == 200  # the id is free again


async def test_sweep_runs_in_the_lifespan(make_gateway) -> None:
    clock = FakeClock()
    gw = await make_gateway(clock=clock, rollout_ttl_s=10, sweep_interval_s=0.01)
    await gw.register("r1")
    clock.advance(11)
    for _ in range(200):
        if len(gw.gateway.registry) == 0:
            break
        await asyncio.sleep(0.005)
    assert len(gw.gateway.registry) == 0


async def test_registry_bound_is_503_with_a_message(make_gateway) -> None:
    clock = FakeClock()
    gw = await make_gateway(clock=clock, max_rollouts=2, rollout_ttl_s=100)
    assert (await gw.register("a")).status_code == 200
    assert (await gw.register("b")).status_code == 200
    r = await gw.register("c")
    assert r.status_code == 503
    assert "limit of 2" in r.json()["error"]["message"]
    await gw.client.post("/v1/rollouts/a/unregister")
    assert (await gw.register("c")).status_code == 200
    clock.advance(101)  # idle rollouts are expired to make room
    assert (await gw.register("d")).status_code == 200


async def test_turns_of_one_rollout_are_serialised(make_gateway) -> None:
    upstream = RecordingUpstream(latency_s=0.05)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    bodies = [[{"role": "user", "content": f"turn-{i}"}] for i in range(3)]
    results = await asyncio.gather(*(gw.chat("r1", b) for b in bodies))
    assert [r.status_code for r in results] == [200, 200, 200]
    kinds = [kind for kind, _, _ in upstream.events]
    assert kinds == ["start", "end"] * 3  # never two turns of r1 upstream at once
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    order = [e[1] for e in upstream.events if e[0] == "start"]
    assert [s["prompt"][0]["content"] for s in steps] == order


async def test_rollouts_do_not_block_each_other(make_gateway) -> None:
    upstream = RecordingUpstream(latency_s=0.1)
    gw = await make_gateway(upstream.app())
    n = 10
    for i in range(n):
        await gw.register(f"r{i}")
    results = await asyncio.gather(
        *(gw.chat(f"r{i}", [{"role": "user", "content": f"r{i}"}]) for i in range(n))
    )
    assert all(r.status_code == 200 for r in results)
    # Serialised, each would end before the next started (and take 1 s): the overlap is
    # the property, and it does not depend on how fast the machine is.
    starts = [t for kind, _, t in upstream.events if kind == "start"]
    ends = [t for kind, _, t in upstream.events if kind == "end"]
    assert max(starts) < min(ends)  # all were upstream at the same time


async def test_cancel_does_not_wait_for_a_turn_in_flight(make_gateway) -> None:
    upstream = RecordingUpstream(latency_s=1.0)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    turn = asyncio.create_task(gw.chat("r1", MESSAGES))
    await eventually(lambda: bool(upstream.events))  # the turn is upstream
    assert (await gw.client.post("/v1/rollouts/r1/cancel")).status_code == 200
    assert not turn.done()  # the cancel answered while the turn was still upstream
    assert (await turn).status_code == 200  # the turn under way completes
    assert (await gw.chat("r1", MESSAGES)).status_code == 403


async def test_turn_waiting_on_lock_after_unregister_is_404(make_gateway) -> None:
    upstream = RecordingUpstream(latency_s=0.1)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    first = asyncio.create_task(gw.chat("r1", MESSAGES))
    await asyncio.sleep(0.02)
    other = [{"role": "user", "content": script({"say": "other"})}]
    second = asyncio.create_task(gw.chat("r1", other))  # a new turn, not a retry
    await asyncio.sleep(0.02)
    assert (await gw.client.post("/v1/rollouts/r1/unregister")).status_code == 200
    assert (await first).status_code == 200
    assert (await second).status_code == 404


async def test_health_counts(gw: GatewayHarness) -> None:
    for i in range(3):
        await gw.register(f"r{i}")
    assert (await gw.client.get("/health")).json()["active_rollouts"] == 3


async def test_memory_is_trimmed_after_many_rollouts_go_away(gw: GatewayHarness) -> None:
    calls: list[int] = []
    from rollout_gateway.server.ops.memory import MemoryTrimmer

    gw.gateway.trimmer = MemoryTrimmer(every=3, trim=lambda: calls.append(1))
    for i in range(7):
        await gw.register(f"m{i}")
        await gw.client.post(f"/v1/rollouts/m{i}/unregister")
        await asyncio.sleep(0.01)
    assert len(calls) == 2
