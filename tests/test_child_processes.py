"""Servers the test bed starts die with the process that started them, even by kill -9.

The parent here is a real process (its own process group, ours to kill) that starts a
``redis-server`` through ``tests/support/local_cluster.py`` from a thread that ends
before the parent is killed (the parent-death signal follows the forking thread:
``rollout_gateway/child_processes.py`` forks from a thread of its own)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout_gateway import child_processes

TESTS = Path(__file__).resolve().parent

PARENT = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from support.local_cluster import RedisServer

redis = RedisServer(Path({directory!r}))
starter = threading.Thread(target=redis.start)  # a short-lived thread starts it
starter.start()
starter.join()
print(redis.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie waiting for its reaper serves nothing


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


@pytest.mark.skipif(not child_processes.available(), reason="no PR_SET_PDEATHSIG here")
def test_redis_server_of_the_test_bed_dies_when_its_parent_is_killed(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    code = PARENT.format(tests=str(TESTS), directory=str(tmp_path / "redis"))
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: ours to kill
    )
    redis_pid = 0
    try:
        assert parent.stdout is not None
        redis_pid = int(parent.stdout.readline())
        time.sleep(0.5)  # the starting thread has ended: the server must still serve
        assert not _gone(redis_pid), "the server died with the thread that started it"
        os.killpg(parent.pid, signal.SIGKILL)  # no finally, no atexit: only the kernel
        parent.wait(timeout=10)
        assert _wait_gone(redis_pid, 10), f"redis-server {redis_pid} outlived its parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
        if redis_pid and not _gone(redis_pid):
            os.killpg(redis_pid, signal.SIGKILL)  # its own group, started by our parent


def test_a_child_started_from_a_thread_outlives_the_thread() -> None:
    started: list[subprocess.Popen[bytes]] = []
    worker = threading.Thread(target=lambda: started.append(child_processes.spawn(["sleep", "30"])))
    worker.start()
    worker.join()
    child = started[0]
    try:
        time.sleep(0.3)
        assert child.poll() is None
        assert os.getpgid(child.pid) == child.pid  # its own group
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
