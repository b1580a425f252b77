"""Several gateways on one shared store (``MemoryStore(shared=True)``, as gateways share
Redis): any turn of a rollout may land on any gateway, round robin with no stickiness.

Trajectories equal one gateway's; a retry sent to another gateway while its original runs
gets the original's answer (no second engine call); cancel and unregister at one gateway
hold at the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.state.memory import MemoryStore

from ..conftest import ADMIN_TOKEN, UPSTREAM, RecordingUpstream, script

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
STEPS = [{"tool": "run", "arguments": {"cmd": f"step {i}"}} for i in range(4)] + [{"say": "done"}]


@contextlib.asynccontextmanager
async def gateways(upstream: Any, store: Any, count: int) -> AsyncIterator[list[httpx.AsyncClient]]:
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(count):
            config = GatewayConfig(upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN)
            app = create_app(config, upstream_transport=httpx.ASGITransport(upstream), store=store)
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


async def test_round_robin_turns_record_one_gateways_trajectory() -> None:
    upstream = RecordingUpstream().app()
    async with gateways(upstream, MemoryStore(), 1) as one:
        alone = await run_rollout(one, "r1")
    async with gateways(upstream, MemoryStore(shared=True), 3) as three:
        shared = await run_rollout(three, "r1")
        assert shared["num_turns"] == len(STEPS)
        assert comparable(shared) == comparable(alone)
        # Every gateway serves the whole trajectory.
        for client in three:
            r = await client.get("/v1/rollouts/r1/trajectory", headers=ADMIN)
            assert comparable(r.json()) == comparable(alone)


async def test_a_retry_at_another_gateway_gets_the_originals_answer() -> None:
    upstream = RecordingUpstream(latency_s=0.3)
    async with gateways(upstream.app(), MemoryStore(shared=True), 2) as (a, b):
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


async def test_cancel_and_unregister_at_one_gateway_hold_at_the_others() -> None:
    async with gateways(RecordingUpstream().app(), MemoryStore(shared=True), 2) as (a, b):
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


@pytest.mark.parametrize("count", [2])
async def test_registering_one_id_twice_across_gateways_is_a_conflict(count: int) -> None:
    async with gateways(RecordingUpstream().app(), MemoryStore(shared=True), count) as (a, b):
        assert (
            await a.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        ).status_code == 200
        r = await b.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        assert r.status_code == 409


async def test_a_rollout_idle_at_one_gateway_but_busy_at_another_is_not_deleted() -> None:
    from ..conftest import FakeClock

    store = MemoryStore(shared=True)
    upstream = httpx.ASGITransport(RecordingUpstream().app())
    clock = FakeClock()
    config = GatewayConfig(upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN, rollout_ttl_s=60)
    idle = create_app(config, upstream_transport=upstream, store=store, clock=clock)
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
