"""The scale-out test bed (tests/support/local_cluster.py): real redis-server, real
HAProxy, real gateway processes, real kill -9; each stopped by its own process group."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.local_cluster import GatewayGroup, HAProxy, RedisServer, haproxy_config

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
