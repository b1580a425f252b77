"""The scale-out test bed (tests/support/local_cluster.py): real redis-server, real
HAProxy, real gateway processes, real kill -9; each stopped by its own process group."""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.local_cluster import GatewayGroup, HAProxy, RedisServer, free_port, haproxy_config

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import server_thread

ADMIN = "cluster-admin-token-0123456789abcdef"


def _require(binary: str) -> None:
    if shutil.which(binary) is None and not os.path.exists(f"/usr/sbin/{binary}"):
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is not installed: .ci/run installs it")
        pytest.skip(f"{binary} is not installed (apt-get install {binary})")


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    with server_thread(create_scripted_model_app()) as root:
        yield f"{root}/v1"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_haproxy_balances_every_request_and_routes_around_a_killed_gateway(
    tmp_path: Path, model_url: str
) -> None:
    _require("haproxy")
    with GatewayGroup(None, model_url, 3, tmp_path / "gw", admin_token=ADMIN) as gateways:
        with HAProxy(gateways.ports, tmp_path / "lb") as lb:
            headers = {"Authorization": f"Bearer {ADMIN}"}
            # One keep-alive connection, as an env's client holds: still round robin.
            with httpx.Client(base_url=lb.root, headers=headers, timeout=30) as client:
                for i in range(9):
                    r = client.post(f"/v1/rollouts/r{i}/register", json={"model": "m"})
                    assert r.status_code == 200
                per_gateway = [
                    httpx.get(f"{root}/health", timeout=10).json()["active_rollouts"]
                    for root in gateways.roots()
                ]
                assert per_gateway == [3, 3, 3]  # no stickiness
                victim = gateways.pids()[0]
                gateways.kill(0)  # kill -9
                assert not _alive(victim)
                answered = Counter(client.get("/health").status_code for _ in range(12))
                assert answered == Counter({200: 12})  # the balancer routes around it
    assert not any(_alive(pid) for pid in gateways.pids())


def test_redis_keeps_what_it_acknowledged_across_kill_9(tmp_path: Path) -> None:
    _require("redis-server")
    redis = pytest.importorskip("redis")
    with RedisServer(tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url)
        client.set("kept", "yes")
        pid = server.pid
        server.kill()
        assert not _alive(pid)
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, socket_timeout=1).get("kept")
        server.restart()
        assert redis.Redis.from_url(server.url).get("kept") == b"yes"
        client.close()
    assert not _alive(server.pid)


def test_the_haproxy_config_is_round_robin_without_stickiness() -> None:
    config = haproxy_config(8000, [8001, 8002])
    assert "balance roundrobin" in config
    assert "server gateway1 127.0.0.1:8002 check" in config
    assert "stick" not in config and "cookie" not in config


def _answered_by(lb_root: str, count: int) -> Counter[str]:
    """Which gateways answered ``count`` requests through the balancer."""
    with httpx.Client(base_url=lb_root, timeout=10) as client:
        return Counter(client.get("/health/live").headers["X-Gateway"] for _ in range(count))


def _until(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``predicate()`` held (fails past ``timeout_s``)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "not within the timeout"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_gateway_whose_upstream_dies_leaves_the_rotation_and_comes_back(
    tmp_path: Path, model_url: str
) -> None:
    """Issue 34: ``/health`` is 503 while the gateway reaches no upstream, so HAProxy's
    check takes it out (about 2 s: a probe a second, two failed checks 500 ms apart) and
    puts it back when the upstream answers again. When no gateway is ready, requests still
    reach the live ones (the control plane works; turns get the gateway's 502)."""
    _require("haproxy")
    port = free_port()
    dying = server_thread(create_scripted_model_app(), port=port)
    dying.__enter__()
    try:
        with (
            GatewayGroup(
                None, f"http://127.0.0.1:{port}/v1", 1, tmp_path / "a", admin_token=ADMIN
            ) as a,
            GatewayGroup(None, model_url, 1, tmp_path / "b", admin_token=ADMIN) as b,
            HAProxy([*a.ports, *b.ports], tmp_path / "lb") as lb,
        ):
            assert _answered_by(lb.root, 10) == Counter(gateway0=5, gateway1=5)
            dying.__exit__(None, None, None)
            out_after = _until(lambda: _answered_by(lb.root, 6) == Counter(gateway1=6), 10)
            health = httpx.get(f"{a.roots()[0]}/health", timeout=10)
            assert health.status_code == 503 and health.json()["reasons"] == [
                "upstream 1 unreachable"
            ]
            assert "does not answer" not in a.log(0)  # it did answer at start
            assert "is down: unreachable" in a.log(0)
            dying = server_thread(create_scripted_model_app(), port=port)
            dying.__enter__()
            back_after = _until(lambda: len(_answered_by(lb.root, 6)) == 2, 10)
    finally:
        dying.__exit__(None, None, None)
    print(f"out of rotation after {out_after:.2f} s, back after {back_after:.2f} s")
    assert out_after < 5 and back_after < 5  # ~2 s and ~1.5 s on an idle machine


def test_with_no_gateway_ready_requests_reach_the_live_ones(tmp_path: Path) -> None:
    _require("haproxy")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with (
        GatewayGroup(None, dead, 1, tmp_path / "gw", admin_token=ADMIN) as gateways,
        HAProxy(gateways.ports, tmp_path / "lb") as lb,
    ):
        time.sleep(1.5)  # HAProxy's checks find it unready
        assert "does not answer" in gateways.log(0)  # serve's warning at start
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=lb.root, headers=headers, timeout=10) as client:
            health = client.get("/health")  # the gateway's own answer, not HAProxy's 503
            assert health.status_code == 503 and health.headers["X-Gateway"] == "gateway0"
            assert health.json()["status"] == "unhealthy"
            register = client.post("/v1/rollouts/r0/register", json={"model": "m"})
            assert register.status_code == 200, register.text
            assert client.post("/v1/rollouts/r0/unregister").status_code == 200
