"""A real Redis server for the Redis backend's tests (``redis-server`` from Debian).

``.ci/run`` installs it; without it these tests fail in CI and are skipped elsewhere
(saying so), since a developer's machine may lack the package.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.local_cluster import RedisServer


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


_shared: RedisServer | None = None


def shared_redis_url() -> str:
    """The URL of one Redis server for the whole test session (started on first use,
    stopped when the session's process exits); tests keep apart by key prefix."""
    global _shared
    require_redis_server()
    if _shared is None:
        directory = Path(tempfile.mkdtemp(prefix="rollout-gateway-redis-"))
        _shared = RedisServer(directory, fsync="everysec").start()
        atexit.register(_stop_shared, directory)
    return _shared.url


def _stop_shared(directory: Path) -> None:
    if _shared is not None:
        _shared.stop()
    shutil.rmtree(directory, ignore_errors=True)
