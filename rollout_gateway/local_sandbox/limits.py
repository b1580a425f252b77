"""A sandbox's resource limits (processes, memory, disk, CPU), how this host enforces
each, and the watchdog's check of a live sandbox.

Enforcement, strongest available first:

- **processes**: the sandbox's ``pids`` cgroup (every process and thread it has at
  once); else, where the sandbox has its own uid, ``RLIMIT_NPROC`` of that uid (the
  same count, kept by the kernel per uid).
- **memory**: the sandbox's ``memory`` cgroup (everything it has resident, RAM-backed
  files such as bwrap's ``/tmp`` included, no swap); else ``RLIMIT_AS`` per process.
  bwrap's ``/tmp`` (RAM) is also bounded in size by the memory limit.
- **disk**: the sandbox's own loop-mounted file system of that size
  (:mod:`~rollout_gateway.local_sandbox.disks`: writes past it fail with ``ENOSPC``);
  else the watchdog measures what the sandbox's directories hold. ``RLIMIT_FSIZE``
  bounds every single file in both cases.
- **CPU**: a CPU quota in the sandbox's ``cpu`` cgroup where there is one, and
  ``RLIMIT_CPU`` (CPU seconds per process) always.

A sandbox that reaches its process, memory or disk limit is **stopped**: the watchdog
(the client's reaper thread) kills every process in it and records why; its files stay
for scoring until it is deleted, and commands that ended because of it report the reason
on stderr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollout_gateway.local_sandbox import cgroups, disks

_GiB = 1024**3

#: Processes (and threads) a sandbox may have at once when the caller names no limit.
DEFAULT_PIDS = 1024


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandbox may use (``None``: no limit of that kind)."""

    memory_bytes: int | None
    disk_bytes: int | None
    pids: int | None
    cpu_cores: float | None

    @classmethod
    def of(
        cls,
        *,
        memory_gb: float | None,
        disk_size_gb: float | None,
        pids: int | None,
        cpu_cores: float | None,
    ) -> SandboxLimits:
        """From a request's figures (GB as prime-sandboxes counts them: GiB)."""

        def size(gb: float | None) -> int | None:
            return int(gb * _GiB) if gb is not None and gb > 0 else None

        return cls(
            memory_bytes=size(memory_gb),
            disk_bytes=size(disk_size_gb),
            pids=pids if pids is not None and pids > 0 else None,
            cpu_cores=cpu_cores if cpu_cores is not None and cpu_cores > 0 else None,
        )


def enforcement(uses_sandbox_uid: bool) -> dict[str, str]:
    """How this host enforces each limit, in words (``--help`` and the docs)."""
    cg = cgroups.availability()
    version = None if cg is not None else cgroups.hierarchy()
    where = f"cgroup v{version.version}" if isinstance(version, cgroups.Hierarchy) else None
    disk_why = disks.availability()
    return {
        "processes": f"{where} pids.max (the whole sandbox)"
        if where
        else (
            "RLIMIT_NPROC of the sandbox's uid"
            if uses_sandbox_uid
            else f"not enforced (no cgroups: {cg})"
        ),
        "memory": f"{where} memory limit (the whole sandbox, RAM-backed /tmp included)"
        if where
        else f"RLIMIT_AS per process only (no cgroups: {cg})",
        "disk": "own ext4 file system of that size (ENOSPC at the limit)"
        if disk_why is None
        else f"watchdog: measured every second, sandbox stopped when over ({disk_why})",
        "cpu": f"{where} CPU quota and RLIMIT_CPU" if where else "RLIMIT_CPU per process",
    }


def breach(
    limits: SandboxLimits,
    group: cgroups.SandboxCgroup | None,
    events_before: dict[str, int],
    disk_mounted: bool,
    disk_path: str,
) -> str | None:
    """Why a live sandbox is past a limit now, else ``None`` (blocking: the reaper
    thread calls it)."""
    from pathlib import Path

    if group is not None:
        events = group.events()
        if events["oom_kill"] > events_before.get("oom_kill", 0):
            size = _size(limits.memory_bytes)
            return f"memory limit ({size}) reached: the kernel killed a process"
        if events["pids_max"] > events_before.get("pids_max", 0):
            return f"process limit ({limits.pids}) reached: a fork was refused"
    if limits.disk_bytes is not None:
        base = Path(disk_path)
        if disk_mounted:
            if disks.free_bytes(base) < 1024 * 1024:
                return f"disk limit ({_size(limits.disk_bytes)}) reached: its file system is full"
        elif disks.usage_bytes(base) >= limits.disk_bytes:
            return f"disk limit ({_size(limits.disk_bytes)}) reached"
    return None


def _size(n: int | None) -> str:
    if n is None:
        return "none"
    for unit, scale in (("GiB", _GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            value = n / scale
            exact = math.isclose(value, round(value))
            return f"{value:.0f} {unit}" if exact else f"{value:.1f} {unit}"
    return f"{n} bytes"


__all__ = ["DEFAULT_PIDS", "SandboxLimits", "breach", "enforcement"]
