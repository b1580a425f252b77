"""Servers the test bed starts die with the process that started them, even by kill -9.

The parent here is a real process (its own process group, ours to kill) that starts a
``redis-server`` through ``tests/support/local_cluster.py`` from a thread that ends
before the parent is killed (the parent-death signal follows the forking thread:
``rollout_gateway/child_processes.py`` forks from a thread of its own)."""

from __future__ import annotations

import contextlib
import os
import resource
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


SHELL_PARENT = """
import subprocess, sys, threading, time
from rollout_gateway import child_processes

def start():
    shell = child_processes.spawn(
        ["bash", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE,
        whole_group={whole_group},
    )
    print(shell.stdout.readline().decode().strip(), flush=True)

starter = threading.Thread(target=start)  # a short-lived thread starts it
starter.start()
starter.join()
time.sleep(600)
"""

ASYNC_PARENT = """
import asyncio, time
from rollout_gateway import child_processes

async def main():
    child = await child_processes.spawn_async("sleep", "600")
    print(child.pid, flush=True)
    time.sleep(600)  # the loop's thread lives on, blocked: only the kill ends it

asyncio.run(main())
"""


def _grandchild_after_parent_killed(code: str) -> tuple[int, bool]:
    """Run ``code`` as a parent in its own group, read the pid it prints, ``kill -9`` the
    parent; that pid and whether it ended within 10 s. Anything left is killed."""
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pid = 0
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        time.sleep(0.3)
        assert not _gone(pid), "the child died before its parent"
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        return pid, _wait_gone(pid, 10)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
        if pid and not _gone(pid):
            os.kill(pid, signal.SIGKILL)  # started (indirectly) by our parent, for this test


needs_prctl = pytest.mark.skipif(not child_processes.available(), reason="no PR_SET_PDEATHSIG")


@needs_prctl
def test_whole_group_takes_a_shells_background_server_along_when_the_parent_is_killed() -> None:
    pid, ended = _grandchild_after_parent_killed(SHELL_PARENT.format(whole_group=True))
    assert ended, f"the shell's background job {pid} outlived the parent"


@needs_prctl
def test_without_whole_group_a_shells_background_job_outlives_the_parent() -> None:
    """Why ``whole_group`` exists: a fork clears the parent-death signal."""
    pid, ended = _grandchild_after_parent_killed(SHELL_PARENT.format(whole_group=False))
    assert not ended, f"{pid} ended: the parent-death signal reached a grandchild"


@needs_prctl
def test_a_child_of_spawn_async_dies_when_its_parent_is_killed() -> None:
    pid, ended = _grandchild_after_parent_killed(ASYNC_PARENT)
    assert ended, f"sleep {pid} (spawn_async) outlived its parent"


def test_whole_group_ends_as_the_command_ends() -> None:
    exited = child_processes.spawn(["sh", "-c", "exit 3"], whole_group=True)
    assert exited.wait(timeout=30) == 3
    sleeper = child_processes.spawn(["sleep", "600"], whole_group=True)
    try:
        time.sleep(0.5)  # the keeper has started the command
        sleeper.terminate()  # to the keeper only: passed on to the command
        assert sleeper.wait(timeout=30) == -signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sleeper.pid, signal.SIGKILL)


def test_the_callers_preexec_runs_in_the_child() -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    child = child_processes.spawn(
        ["sh", "-c", "ulimit -n"], stdout=subprocess.PIPE, text=True, preexec=limit
    )
    out, _ = child.communicate(timeout=30)
    assert out.strip() == "64"
