"""Process supervision for local sandboxes: spawn a confined command, wait for it without
blocking the event loop, and kill what a sandbox runs.

Linux ``/proc`` helpers live here too. Functions without ``async`` block (briefly); the
client calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Collection, Iterable
from pathlib import Path

from rollout_gateway.local_sandbox.isolation import Confinement, confining_argv

MARKER_ENV_VAR = "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ID"
"""Set in every sandboxed process (``process-group`` mode finds stragglers by it)."""

_GiB = 1024**3


def rlimit_args(
    *,
    timeout_minutes: float,
    cpu_cores: float | None,
    memory_gb: float | None,
    disk_size_gb: float | None,
    nproc: int | None = None,
) -> list[str]:
    """``prlimit`` prefix: CPU time, address space, largest file, no core dumps, and (for
    a command running as the sandbox's own uid) the processes that uid may have."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        return []
    limits = {"core": 0, "cpu": int(timeout_minutes * 60 * max(1, math.ceil(cpu_cores or 1)))}
    if memory_gb and memory_gb > 0:
        limits["as"] = int(memory_gb * _GiB)
    if disk_size_gb and disk_size_gb > 0:
        limits["fsize"] = int(disk_size_gb * _GiB)
    if nproc is not None and nproc > 0:
        limits["nproc"] = nproc
    current = {
        "core": resource.RLIMIT_CORE,
        "cpu": resource.RLIMIT_CPU,
        "as": resource.RLIMIT_AS,
        "fsize": resource.RLIMIT_FSIZE,
        "nproc": resource.RLIMIT_NPROC,
    }
    args = [prlimit]
    for name, value in limits.items():
        _, hard = resource.getrlimit(current[name])
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        args.append(f"--{name}={value}")
    return [*args, "--"]


def spawn(
    confinement: Confinement,
    script: str,
    env: dict[str, str],
    stdout_path: Path,
    stderr_path: Path,
    limits: list[str],
    prefix: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``/bin/sh -c script`` confined, in its own session; output appended to files.

    ``prefix`` runs first, on the host (e.g. entering the sandbox's cgroups)."""
    argv = [*(prefix or []), *confining_argv(confinement), *limits, "/bin/sh", "-c", script]
    with open(stdout_path, "ab") as out, open(stderr_path, "ab") as err:
        return subprocess.Popen(
            argv,
            cwd=confinement.work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # own session + process group: killable as one
            close_fds=True,
        )


def spawn_piped(
    confinement: Confinement,
    script: str,
    env: dict[str, str],
    limits: list[str],
    prefix: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Like :func:`spawn`, with stdin, stdout and stderr as pipes (a live process)."""
    argv = [*(prefix or []), *confining_argv(confinement), *limits, "/bin/sh", "-c", script]
    return subprocess.Popen(
        argv,
        cwd=confinement.work,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


def exit_code(rc: int) -> int:
    """Shell convention (128 + signal) for a process killed by a signal."""
    return 128 - rc if rc < 0 else rc


async def wait_proc(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for ``proc`` without blocking the loop; ``None`` on timeout.

    The loop is woken when the process exits (its pidfd turns readable: Linux 5.3 and
    later), so a command's end is seen at once and a long one costs nothing while it
    runs; elsewhere (no pidfd) it is polled (:func:`poll_proc`).
    """
    rc = proc.poll()
    if rc is not None:
        return rc
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux, an old kernel, or a seccomp filter
        return await poll_proc(proc, timeout)
    try:
        return await _wait_pidfd(proc, pidfd, timeout)
    finally:
        os.close(pidfd)


async def _wait_pidfd(proc: subprocess.Popen[bytes], pidfd: int, timeout: float) -> int | None:
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        limit = None if math.isinf(timeout) else max(timeout, 0.0)
        await asyncio.wait_for(exited, limit)
    except TimeoutError:
        return proc.poll()  # (None: still running)
    finally:
        loop.remove_reader(pidfd)
    rc = proc.poll()
    if rc is None:  # exited, but another thread is reaping it (it holds Popen's lock)
        rc = await poll_proc(proc, _REAPED_ELSEWHERE_S)
    return rc


#: How long a command seen to exit may take to be reaped by another thread's ``wait``.
_REAPED_ELSEWHERE_S = 5.0


async def poll_proc(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for ``proc`` by polling it (every 1 ms, doubling to 25 ms); ``None`` on
    timeout. :func:`wait_proc`'s way where the kernel offers no pidfd."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        rc = proc.poll()
        if rc is not None:
            return rc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        await asyncio.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.025)


def kill_group(proc: subprocess.Popen[bytes], settle_s: float = 1.0) -> None:
    """SIGKILL a command's whole process group and return once none of it still runs.

    The group is signalled even when its leader already exited: its children keep the
    group id (the kernel does not reuse it while they live). In the namespace modes the
    leader is the outer ``bwrap``/``unshare``, whose death ends the command's namespace.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=2)
    deadline = time.monotonic() + settle_s
    while group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.005)


def kill_leaders(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM the process groups of live leaders, SIGKILL what outlives ``grace``, reap."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in live):
        time.sleep(0.01)
    for proc in live:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:  # reap, so no zombie of ours stays behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)


def kill_marked(sandbox_id: str, sessions: Collection[int]) -> None:
    """``process-group`` mode: SIGKILL processes left in the sandbox's sessions or
    carrying its marker variable (best effort: ``env -i`` + ``setsid`` escapes it)."""
    stragglers = marked_pids(sandbox_id, sessions)
    signal_pids(stragglers, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while stragglers and time.monotonic() < deadline:
        stragglers = {pid for pid in stragglers if pid_running(pid)}
        if stragglers:
            time.sleep(0.01)


def proc_pids() -> Iterable[int]:
    """Every pid in ``/proc`` (empty when not Linux)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(n) for n in names if n.isdigit()]


def read_proc_file(path: str) -> bytes | None:
    """A ``/proc`` file's bytes, ``None`` when it cannot be read (the process is gone,
    or not ours to read). By raw descriptor: a Python file object costs more than the
    read itself here, and a deletion reads two files of every process on the machine."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks)


def stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` fields after the command name: state ppid pgrp session ..."""
    stat = read_proc_file(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def pid_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is its new parent's to reap)."""
    fields = stat_fields(pid)
    return fields is not None and bool(fields) and fields[0] != b"Z"


def group_running(pgid: int) -> bool:
    """Whether a live (non-zombie) process of process group ``pgid`` remains (Linux)."""
    try:
        os.killpg(pgid, 0)  # (signal 0: only asks whether the group has a process)
    except ProcessLookupError:
        return False  # none at all, not even a zombie: no need to scan /proc
    except PermissionError:
        pass  # a member not ours to signal: look at each
    for pid in proc_pids():
        fields = stat_fields(pid)
        if fields is not None and len(fields) > 2 and fields[0] != b"Z":
            if int(fields[2]) == pgid:
                return True
    return False


def marked_pids(sandbox_id: str, sessions: Collection[int] = ()) -> set[int]:
    """Live processes in one of ``sessions`` (as session or group id) or carrying the
    sandbox's marker in their environment."""
    needle = f"{MARKER_ENV_VAR}={sandbox_id}".encode()
    session_ids = set(sessions)
    found: set[int] = set()
    me = os.getpid()
    for pid in proc_pids():
        if pid == me:
            continue
        fields = stat_fields(pid)
        if fields is None or len(fields) < 4 or fields[0] == b"Z":
            continue
        if int(fields[2]) in session_ids or int(fields[3]) in session_ids:
            found.add(pid)
            continue
        environ = read_proc_file(f"/proc/{pid}/environ")
        # (The substring test first: the split, which makes the match exact, is rare.)
        if environ is not None and needle in environ and needle in environ.split(b"\0"):
            found.add(pid)
    return found


def signal_pids(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each pid, ignoring those already gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


__all__ = [
    "MARKER_ENV_VAR",
    "exit_code",
    "kill_group",
    "kill_leaders",
    "kill_marked",
    "poll_proc",
    "rlimit_args",
    "spawn",
    "spawn_piped",
    "wait_proc",
]
