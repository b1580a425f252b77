"""A real Redis server for the Redis backend's tests (``redis-server`` from Debian).

``.ci/run`` installs it; without it these tests fail in CI and are skipped elsewhere
(saying so), since a developer's machine may lack the package.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_gateway.local_cluster import RedisServer


def require_redis_server() -> None:
    """Skip (or fail in CI) when ``redis-server`` is not installed."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed: .ci/run installs it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


def redis_server(directory: Path) -> Iterator[RedisServer]:
    """A Redis server on a free loopback port, stopped afterwards."""
    require_redis_server()
    pytest.importorskip("redis")
    with RedisServer(directory) as server:
        yield server
