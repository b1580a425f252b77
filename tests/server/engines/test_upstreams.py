"""Upstream failures map to clear statuses; rollouts are pinned to healthy, least-loaded ones."""

from __future__ import annotations

import asyncio
import time

import httpx
from support.local_cluster import free_port

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import running_server

from ..conftest import RecordingUpstream, SwitchableTransport, script

MESSAGES = [{"role": "user", "content": script({"say": "hi"})}]
A, B, C = "http://a/v1", "http://b/v1", "http://c/v1"


def error(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()["error"]
    return response.status_code, body["type"], body["message"]


async def test_upstream_4xx_is_400_with_its_message(make_gateway) -> None:
    upstream = RecordingUpstream(
        status=400, error_body={"error": {"message": "This model's maximum context is 8192"}}
    )
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    status, kind, message = error(await gw.chat("r1", MESSAGES))
    assert (status, kind) == (400, "upstream_error")
    assert "maximum context is 8192" in message
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 0 and traj["status"] == "active"  # failed turns are not turns
    metrics = (await gw.client.get("/metrics")).text
    assert (
        'rollout_gateway_upstream_errors_total{upstream="http://upstream-a/v1",kind="http_4xx"} 1'
        in (metrics)
    )


async def test_upstream_429_stays_429(make_gateway) -> None:
    gw = await make_gateway(RecordingUpstream(status=429, error_body={"message": "busy"}).app())
    await gw.register("r1")
    assert error(await gw.chat("r1", MESSAGES))[0] == 429


async def test_upstream_5xx_is_502_without_its_internals(make_gateway, caplog) -> None:
    gw = await make_gateway(RecordingUpstream(status=500, error_body={"detail": "boom"}).app())
    await gw.register("r1")
    status, _, message = error(await gw.chat("r1", MESSAGES))
    assert status == 502 and "boom" not in message and "upstream-a" not in message
    assert "boom" in caplog.text  # the operator sees it in the log


async def test_upstream_non_json_is_502(make_gateway) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy page</html>")

    gw = await make_gateway({A: httpx.MockTransport(handler)})
    await gw.register("r1")
    status, _, message = error(await gw.chat("r1", MESSAGES))
    assert status == 502 and "non-JSON" in message


async def test_upstream_down_is_502_without_hanging(make_gateway) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    gw = await make_gateway({dead: httpx.AsyncHTTPTransport()}, upstream_connect_timeout_s=2)
    await gw.register("r1")
    start = time.perf_counter()
    status, _, message = error(await gw.chat("r1", MESSAGES))
    assert status == 502 and "unreachable" in message
    assert time.perf_counter() - start < 2
    health = (await gw.client.get("/health")).json()
    assert health["upstreams"][0]["healthy"] is False
    # The server keeps serving.
    assert (await gw.register("r2")).status_code == 200


async def test_upstream_timeout_is_502(make_gateway) -> None:
    # Timeouts are enforced by the network transport: serve the slow upstream for real.
    async with running_server(RecordingUpstream(latency_s=1.5).app()) as root:
        url = f"{root}/v1"
        gw = await make_gateway({url: httpx.AsyncHTTPTransport()}, upstream_timeout_s=0.05)
        await gw.register("r1")
        start = time.perf_counter()
        status, _, message = error(await gw.chat("r1", MESSAGES))
        assert status == 502 and "timed out" in message
        assert time.perf_counter() - start < 1.0  # not the 1.5 s answer: a slow machine's margin
        assert gw.gateway.pool.get(url).healthy is True  # slow is not down


async def test_pins_to_least_loaded_upstream(make_gateway) -> None:
    model = create_scripted_model_app()
    gw = await make_gateway({u: httpx.ASGITransport(model) for u in (A, B, C)})
    for i in range(6):
        await gw.register(f"r{i}")
    pins = {u["url"]: u["pinned"] for u in (await gw.client.get("/health")).json()["upstreams"]}
    assert pins == {A: 2, B: 2, C: 2}
    # Free two slots on B: the next two rollouts go there.
    records = {r.rollout_id: r.upstream for r in gw.gateway.registry.records()}
    on_b = [rid for rid, url in records.items() if url == B]
    for rid in on_b:
        await gw.client.post(f"/v1/rollouts/{rid}/unregister")
    await gw.register("n1")
    await gw.register("n2")
    assert gw.gateway.registry.get("n1").upstream == B
    assert gw.gateway.registry.get("n2").upstream == B
    # Each rollout's turns go to its pinned upstream.
    assert (await gw.chat("n1", MESSAGES)).status_code == 200
    metrics = (await gw.client.get("/metrics")).text
    assert f'rollout_gateway_turns_total{{upstream="{B}"}} 1' in metrics


async def test_unhealthy_upstream_gets_no_new_rollouts_until_it_recovers(make_gateway) -> None:
    recorder_a, recorder_b = RecordingUpstream(), RecordingUpstream()
    ta, tb = SwitchableTransport(recorder_a.app()), SwitchableTransport(recorder_b.app())
    gw = await make_gateway({A: ta, B: tb}, probe_interval_s=3600)
    await gw.register("r0")  # pinned to A
    assert gw.gateway.registry.get("r0").upstream == A
    ta.down = True
    assert (await gw.chat("r0", MESSAGES)).status_code == 502  # A marked unhealthy
    for i in range(1, 4):
        await gw.register(f"r{i}")
        assert gw.gateway.registry.get(f"r{i}").upstream == B
    # The re-probe brings A back.
    await gw.gateway.pool.probe_unhealthy()
    assert gw.gateway.pool.get(A).healthy is False  # still down
    ta.down = False
    probes = recorder_a.model_probes  # the start-up engine probe is one more
    await gw.gateway.pool.probe_unhealthy()
    assert gw.gateway.pool.get(A).healthy is True
    assert recorder_a.model_probes == probes + 1
    await gw.register("r4")
    assert gw.gateway.registry.get("r4").upstream == A  # least loaded again


async def test_success_marks_healthy_and_all_unhealthy_falls_back(make_gateway) -> None:
    ta = SwitchableTransport(create_scripted_model_app())
    gw = await make_gateway({A: ta}, probe_interval_s=3600)
    await gw.register("r1")
    ta.down = True
    assert (await gw.chat("r1", MESSAGES)).status_code == 502
    # With every upstream unhealthy, register still pins (the mark may be stale).
    assert (await gw.register("r2")).status_code == 200
    ta.down = False
    assert (await gw.chat("r1", MESSAGES)).status_code == 200
    assert gw.gateway.pool.get(A).healthy is True


async def test_periodic_probe_runs_in_the_lifespan(make_gateway) -> None:
    ta = SwitchableTransport(create_scripted_model_app())
    gw = await make_gateway({A: ta}, probe_interval_s=0.01)
    await gw.register("r1")
    ta.down = True
    await gw.chat("r1", MESSAGES)
    ta.down = False
    for _ in range(200):
        if gw.gateway.pool.get(A).healthy:
            break
        await asyncio.sleep(0.005)
    assert gw.gateway.pool.get(A).healthy
