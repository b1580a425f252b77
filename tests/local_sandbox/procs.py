"""Finding a sandbox's processes from the host by a unique marker in their command line
(pids printed inside a sandbox are namespace-local in the namespace modes)."""

from __future__ import annotations

import asyncio
import os
import secrets
import time


def markers(n: int) -> list[int]:
    """``n`` unique numbers for ``sleep <n>`` commands (found again by :func:`host_pids`)."""
    base = 50_000_000 + secrets.randbelow(10_000_000) * 10
    return [base + i for i in range(n)]


def host_pids(marker: int) -> set[int]:
    """Live (non-zombie) host processes whose command line is ``sleep <marker>``."""
    needle = f"sleep\0{marker}\0".encode()
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline == needle and state != "Z":
            found.add(int(name))
    return found


async def wait_running(*marks: int, timeout: float = 30.0) -> None:
    """Wait until a ``sleep <mark>`` runs for each mark."""
    deadline = time.monotonic() + timeout
    while any(not host_pids(m) for m in marks):
        if time.monotonic() > deadline:
            missing = [m for m in marks if not host_pids(m)]
            raise AssertionError(f"sleep {missing} never started")
        await asyncio.sleep(0.02)


def assert_none_running(*marks: int, settle: float = 5.0) -> None:
    """No ``sleep <mark>`` is left (after at most ``settle`` seconds for SIGKILL to land)."""
    deadline = time.monotonic() + settle
    while True:
        alive = {m: host_pids(m) for m in marks if host_pids(m)}
        if not alive:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes survived: {alive}")
        time.sleep(0.02)
