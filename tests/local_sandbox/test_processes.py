"""Waiting for a sandbox's command without blocking the loop: its exit status as soon as
it ends, ``None`` at the timeout (the command left running), with the kernel's pidfd
and with the polling used where there is none; nothing of the wait left behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable

import pytest

from rollout_gateway.local_sandbox import processes

Wait = Callable[["subprocess.Popen[bytes]", float], Awaitable[int | None]]
SLEEP = shutil.which("sleep") or "/bin/sleep"
WAYS: list[Wait] = [processes.wait_proc, processes.poll_proc]


def shell(script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True)


def exec_done(proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc``'s new program has its environment in place (``Popen`` may
    return while the kernel is still setting up the exec, when ``/proc`` shows none)."""
    for _ in range(5000):
        if processes.read_proc_file(f"/proc/{proc.pid}/environ"):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {proc.pid} shows no environment")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("wait", WAYS, ids=["pidfd", "poll"])
async def test_the_exit_status_of_each_of_many_commands(wait: Wait) -> None:
    procs = [shell(f"sleep 0.0{i % 3}; exit {i}") for i in range(20)]
    codes = await asyncio.gather(*(wait(p, 30) for p in procs))
    assert codes == list(range(20))


@pytest.mark.parametrize("wait", WAYS, ids=["pidfd", "poll"])
async def test_a_command_killed_by_a_signal_and_one_already_ended(wait: Wait) -> None:
    killed = shell("sleep 30")
    asyncio.get_running_loop().call_later(0.05, os.kill, killed.pid, signal.SIGKILL)
    assert processes.exit_code(await wait(killed, 30) or 0) == 128 + signal.SIGKILL
    ended = shell("exit 7")
    ended.wait()
    assert await wait(ended, 0) == 7


@pytest.mark.parametrize("wait", WAYS, ids=["pidfd", "poll"])
async def test_the_timeout_returns_none_and_leaves_the_command_running(wait: Wait) -> None:
    proc = shell("sleep 30")
    try:
        before = open_fds()
        assert await wait(proc, 0.1) is None
        assert proc.poll() is None
        assert open_fds() == before
        # With no limit (the v1 runtime's wait), it returns when the command ends.
        asyncio.get_running_loop().call_later(0.05, proc.terminate)
        assert await wait(proc, float("inf")) == -signal.SIGTERM
    finally:
        processes.kill_group(proc)


async def test_a_cancelled_wait_leaves_no_reader_or_descriptor() -> None:
    proc = shell("sleep 30")
    try:
        before = open_fds()
        waiting = asyncio.ensure_future(processes.wait_proc(proc, 30))
        await asyncio.sleep(0.05)
        assert open_fds() == before + 1  # the pidfd
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert open_fds() == before
        # The same command waited on again: the earlier wait left nothing in the way.
        asyncio.get_running_loop().call_later(0.05, proc.kill)
        assert await processes.wait_proc(proc, 30) == -signal.SIGKILL
    finally:
        processes.kill_group(proc)


def test_a_proc_file_is_read_whole_or_not_at_all() -> None:
    big = "x" * 100_000  # two of them: past one read of the raw descriptor
    env = {"BIG1": big, "BIG2": big}
    proc = subprocess.Popen([SLEEP, "30"], env=env, start_new_session=True)
    try:
        exec_done(proc)
        environ = processes.read_proc_file(f"/proc/{proc.pid}/environ")
        assert environ == f"BIG1={big}\0BIG2={big}\0".encode()
        assert processes.read_proc_file("/proc/0/stat") is None  # no such process
    finally:
        processes.kill_group(proc)


def test_the_marker_is_matched_exactly_among_many_variables() -> None:
    marker = processes.MARKER_ENV_VAR
    env = {f"V{i}": "y" * 500 for i in range(200)}
    carrier = subprocess.Popen([SLEEP, "30"], env={**env, marker: "sb-1"}, start_new_session=True)
    lookalike = subprocess.Popen(
        [SLEEP, "30"], env={**env, marker: "sb-10", "X": f"{marker}=sb-1x"},
        start_new_session=True,
    )  # fmt: skip
    try:
        exec_done(carrier)
        exec_done(lookalike)
        found = processes.marked_pids("sb-1")
        assert carrier.pid in found
        assert lookalike.pid not in found
        assert processes.marked_pids("sb-10") >= {lookalike.pid}
    finally:
        processes.kill_group(carrier)
        processes.kill_group(lookalike)


def test_a_group_runs_while_a_live_member_does() -> None:
    leader = shell(f"{SLEEP} 30 & wait")
    try:
        assert processes.group_running(leader.pid)
    finally:
        processes.kill_group(leader)
    assert not processes.group_running(leader.pid)  # killed and reaped: no member left
    zombie = shell("exit 0")
    while processes.pid_running(zombie.pid):  # ended, not yet reaped: a zombie member
        pass
    assert not processes.group_running(zombie.pid)
    zombie.wait()


@pytest.mark.parametrize("wait", WAYS, ids=["pidfd", "poll"])
async def test_a_command_another_thread_is_reaping_gives_its_status(wait: Wait) -> None:
    # A deletion reaps a sandbox's commands in a thread (Popen.wait) while their callers
    # wait here: Popen.poll answers None while that thread holds its lock.
    proc = shell("exit 3")
    with proc._waitpid_lock:  # (CPython's: what a wait in another thread holds)
        waiting = asyncio.ensure_future(wait(proc, 30))
        await asyncio.sleep(0.2)  # the command has exited; its waiter cannot reap it
        assert not waiting.done()
    assert await waiting == 3
