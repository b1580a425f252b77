"""``/health`` and the health metrics say whether the gateway can reach its upstreams and
its store, and why not (issue 34, point 5)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.sqlite import SQLiteStore
from rollout_gateway.server.state.store import StoreUnavailableError

from ..conftest import ADMIN_TOKEN, RecordingUpstream, SwitchableTransport
from ..state.redis_fixtures import redis_server

A, B = "http://a/v1", "http://b/v1"
ANONYMOUS = {"Authorization": ""}


async def health(client: httpx.AsyncClient, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    answer = await client.get("/health", **kwargs)
    return answer.status_code, answer.json()


def metric(text: str, name: str) -> float:
    """The value of the one series whose line starts with ``name``."""
    (line,) = [line for line in text.splitlines() if line.startswith(name)]
    return float(line.rsplit(" ", 1)[1])


async def test_a_dead_upstream_is_503_with_its_reason_and_200_once_it_answers(
    make_gateway,
) -> None:
    upstream = SwitchableTransport(create_scripted_model_app())
    gw = await make_gateway({A: upstream}, probe_interval_s=3600)  # probes run by hand
    probe = gw.gateway.health_monitor.probe
    assert (await health(gw.client))[0] == 200
    upstream.down = True
    await probe()
    status, body = await health(gw.client)
    assert (status, body["status"], body["healthy"]) == (503, "unhealthy", False)
    [reason] = body["reasons"]
    assert reason.startswith(f"upstream 1 ({A}): unreachable: ConnectError")
    [store, upstream_check] = body["checks"]
    assert store["up"] is True and upstream_check["up"] is False
    assert upstream_check["failed_probes"] == 1
    # Anyone may ask (a load balancer, an agent): the status and a reason, no URL.
    status, body = await health(gw.client, headers=ANONYMOUS)
    assert (status, body["reasons"]) == (503, ["upstream 1 unreachable"])
    assert A not in str(body) and "checks" not in body
    metrics = (await gw.client.get("/metrics")).text
    assert metric(metrics, "rollout_gateway_healthy ") == 0
    assert metric(metrics, f'rollout_gateway_dependency_up{{kind="upstream",where="{A}"}}') == 0
    assert metric(metrics, 'rollout_gateway_dependency_up{kind="store",where="memory"}') == 1
    # New rollouts are not pinned to an upstream the probe found down (with none up,
    # register still pins: the mark may be stale, and a turn then reports a 502).
    assert gw.gateway.pool.get(A).healthy is False
    upstream.down = False
    await probe()
    status, body = await health(gw.client)
    assert (status, body["status"], body["healthy"]) == (200, "ok", True)
    assert "reasons" not in body and gw.gateway.pool.get(A).healthy
    assert metric((await gw.client.get("/metrics")).text, "rollout_gateway_healthy ") == 1


async def test_one_upstream_of_two_down_is_degraded_and_rollouts_go_to_the_other(
    make_gateway,
) -> None:
    a = SwitchableTransport(create_scripted_model_app())
    b = SwitchableTransport(create_scripted_model_app())
    gw = await make_gateway({A: a, B: b}, probe_interval_s=3600)
    a.down = True
    await gw.gateway.health_monitor.probe()
    status, body = await health(gw.client)
    assert (status, body["status"]) == (200, "degraded")
    assert body["reasons"] == [f"upstream 1 ({A}): unreachable: ConnectError: connection refused"]
    for i in range(3):
        await gw.register(f"r{i}")
        assert gw.gateway.registry.get(f"r{i}").upstream == B


async def test_an_upstream_answering_5xx_is_down_with_its_status(make_gateway) -> None:
    upstream = RecordingUpstream()
    app = upstream.app()

    async def sick(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/models"):
            body = b'{"error": "engine dead"}'
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    gw = await make_gateway(sick, probe_interval_s=3600)
    await gw.gateway.health_monitor.probe()
    status, body = await health(gw.client)
    assert status == 503
    assert body["reasons"] == ["upstream 1 (http://upstream-a/v1): GET /models answered HTTP 503"]


async def test_health_checks_answer_from_the_last_probe_not_one_request_each(
    make_gateway,
) -> None:
    """A load balancer checking every 500 ms, times every gateway, costs the engine
    nothing more: the probe runs on its own timer."""
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app(), probe_interval_s=3600)
    before = upstream.model_probes
    for _ in range(50):
        assert (await gw.client.get("/health")).status_code == 200
    assert upstream.model_probes == before


async def test_the_probe_runs_on_its_timer_and_finds_the_upstream_back(make_gateway) -> None:
    upstream = SwitchableTransport(create_scripted_model_app())
    upstream.down = True
    gw = await make_gateway({A: upstream}, probe_interval_s=0.02)
    # The start-up probe ran before the app served: down from the first request.
    assert (await health(gw.client))[0] == 503
    upstream.down = False
    for _ in range(200):
        if (await health(gw.client))[0] == 200:
            break
        await asyncio.sleep(0.01)
    assert (await health(gw.client))[0] == 200


class FlakyStore(MemoryStore):
    """A memory store whose :meth:`check` fails while ``down``."""

    down = False

    async def check(self) -> None:
        if self.down:
            raise StoreUnavailableError("the state store could not be reached: refused")


@contextlib.asynccontextmanager
async def gateway_on(store: Any, **fields: Any) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewayConfig.from_fields(upstreams=[A], admin_token=ADMIN_TOKEN, **fields)
    transport = httpx.ASGITransport(create_scripted_model_app())
    app = create_app(config, upstream_transport=transport, store=store)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app),
            base_url="http://gateway",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


async def test_a_store_that_cannot_be_used_is_503_with_its_reason() -> None:
    store = FlakyStore()
    async with gateway_on(store, probe_interval_s=3600) as client:
        monitor = client.app.state.gateway.health_monitor  # type: ignore[attr-defined]
        store.down = True
        await monitor.probe()
        status, body = await health(client)
        assert (status, body["status"]) == (503, "unhealthy")
        assert body["reasons"] == [
            "state store (memory): StoreUnavailableError: "
            "the state store could not be reached: refused"
        ]
        assert (await health(client, headers=ANONYMOUS))[1]["reasons"] == [
            "state store unreachable"
        ]
        store.down = False
        await monitor.probe()
        assert (await health(client))[0] == 200


async def test_redis_lost_is_503_and_back_when_redis_is(tmp_path: Path) -> None:
    """The real thing: a Redis killed under the gateway, then started again."""
    for redis in redis_server(tmp_path):
        async with gateway_on(None, redis_url=redis.url, probe_interval_s=3600) as client:
            monitor = client.app.state.gateway.health_monitor  # type: ignore[attr-defined]
            assert (await health(client))[0] == 200
            redis.kill()
            await monitor.probe()
            status, body = await health(client)
            assert status == 503
            [reason] = body["reasons"]
            assert reason.startswith("state store (redis):"), reason
            redis.restart()
            await monitor.probe()
            assert (await health(client))[0] == 200


async def test_sqlite_check_writes_a_row_when_nothing_was_written_lately(tmp_path: Path) -> None:
    """The SQLite store's check is a write (a full disk shows), committed like a turn;
    skipped while other writes succeed (an idle gateway writes a row every 10 s)."""
    store = SQLiteStore(tmp_path / "state")
    await store.open()
    try:
        await store.check()
        first = _checked_at(store)
        await store.check()  # a write succeeded just now: no second row
        assert _checked_at(store) == first
    finally:
        await store.close()


def _checked_at(store: SQLiteStore) -> float:
    with contextlib.closing(sqlite3.connect(store.path)) as conn:
        (value,) = conn.execute("SELECT value FROM meta WHERE key = 'checked_at'").fetchone()
    return float(value)


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs (root only: skipped elsewhere)."""
    path = tmp_path / "volume"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_a_full_disk_under_sqlite_is_503_and_200_once_freed(small_volume: Path) -> None:
    store = SQLiteStore(small_volume / "state")
    async with gateway_on(store, probe_interval_s=3600) as client:
        monitor = client.app.state.gateway.health_monitor  # type: ignore[attr-defined]
        filler = small_volume / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as out:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        # A turn's write fails: the next probe writes (and fails) at once.
        register = await client.post("/v1/rollouts/r1/register", json={"model": "m"})
        assert register.status_code == 503
        await monitor.probe()
        status, body = await health(client)
        assert status == 503
        [reason] = body["reasons"]
        assert reason.startswith("state store (sqlite): StoreUnavailableError"), reason
        assert "full" in reason
        filler.unlink()
        await monitor.probe()
        assert (await health(client))[0] == 200
        assert (
            await client.post("/v1/rollouts/r1/register", json={"model": "m"})
        ).status_code == 200


async def test_liveness_answers_whatever_the_upstream(make_gateway) -> None:
    upstream = SwitchableTransport(create_scripted_model_app())
    upstream.down = True
    gw = await make_gateway({A: upstream}, probe_interval_s=3600)
    answer = await gw.client.get("/health/live", headers=ANONYMOUS)
    assert (answer.status_code, answer.json()) == (200, {"status": "alive"})


@pytest.mark.parametrize("path", ["/health", "/health/live"])
async def test_health_paths_take_no_body_or_other_method(make_gateway, path: str) -> None:
    gw = await make_gateway()
    assert (await gw.client.post(path)).status_code == 405
