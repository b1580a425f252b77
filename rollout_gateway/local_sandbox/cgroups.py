"""Per-sandbox control groups: the kernel's memory, process and CPU limits for everything
a sandbox runs, and the list of its processes.

Both hierarchies are served. cgroup v1 (separate ``memory``, ``pids`` and ``cpu``
controller mounts under ``/sys/fs/cgroup``) and cgroup v2 (one unified tree with
``memory.max``, ``pids.max``, ``cpu.max``). A sandbox's group is made under the env
process's own group where the hierarchy allows it (v1, or a v2 group that may delegate
its controllers), else under the hierarchy's root, as
``rollout-gateway/<sandbox id>``. Commands enter it before they are confined: the
confining command line is prefixed with a root shell that writes its own pid to the
group's ``cgroup.procs`` and then ``exec``\\ s the rest (:meth:`SandboxCgroup.enter_argv`),
so every process the command ever starts is counted and limited.

Each sandbox records its group directories in its ``meta.json``: the stale sweep of a
crashed process's sandboxes removes them wherever they were made (under that process's
own group, which the sweeping process may not share). The last sandbox of a parent made
in the env's own group removes that parent too, so no empty ``rollout-gateway`` group is
left in a group someone else manages; the parents at a hierarchy's root stay.

Making groups needs root (or a delegated v2 subtree); where that fails the sandboxes run
without them and :func:`availability` says why (``--help`` and the docs show it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_NAME = "rollout-gateway"


@dataclass(frozen=True)
class Hierarchy:
    """Where sandbox groups are made: the parent directory per controller (v1: one per
    controller mount; v2: the same directory for all)."""

    version: int
    parents: dict[str, Path]
    #: Parents at a hierarchy's root: shared by every process, never removed (other
    #: processes, of this or an older version, expect them to stay).
    shared: frozenset[Path] = frozenset()

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.parents))


def _own_path(controller: str | None) -> str:
    """The env process's group path in ``controller``'s hierarchy (``None``: v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller is None and names == "":
            return path
        if controller is not None and controller in names.split(","):
            return path
    return "/"


def _writable_parent(base: Path, own: str) -> Path | None:
    """``<own group>/rollout-gateway`` if it can be made, else ``<base>/rollout-gateway``."""
    for parent in (base / own.lstrip("/") / GROUP_NAME, base / GROUP_NAME):
        try:
            parent.mkdir(exist_ok=True)
            return parent
        except OSError:
            continue
    return None


def _v2_wanted() -> list[str]:
    available = set((CGROUP_ROOT / "cgroup.controllers").read_text().split())
    return [c for c in ("memory", "pids", "cpu") if c in available]


def _make_v2_parent(parent: Path) -> None:
    """Make ``parent`` with the controllers enabled on every level down to its children
    (``OSError`` where the hierarchy refuses)."""
    wanted = _v2_wanted()
    parent.mkdir(exist_ok=True)
    levels = [CGROUP_ROOT]
    for part in parent.relative_to(CGROUP_ROOT).parts:
        levels.append(levels[-1] / part)
    for level in levels:
        control = level / "cgroup.subtree_control"
        enabled = set(control.read_text().split())
        missing = [c for c in wanted if c not in enabled]
        if missing:
            control.write_text(" ".join(f"+{c}" for c in missing))


def _v2_parent() -> Path | None:
    """A v2 directory whose children get ``memory`` and ``pids`` (and ``cpu`` if offered)."""
    wanted = _v2_wanted()
    if "memory" not in wanted or "pids" not in wanted:
        return None
    own = _own_path(None)
    for parent in (CGROUP_ROOT / own.lstrip("/") / GROUP_NAME, CGROUP_ROOT / GROUP_NAME):
        try:
            _make_v2_parent(parent)
            return parent
        except OSError:
            continue
    return None


def _make_parent(hierarchy: Hierarchy, parent: Path) -> None:
    """(Re)make a parent of sandbox groups: the last sandbox of a parent made in the env's
    own group removes it (an empty ``rollout-gateway`` group left there would keep
    whoever manages that group from removing it)."""
    if hierarchy.version == 2:
        _make_v2_parent(parent)
    else:
        parent.mkdir(exist_ok=True)


def _remove_if_empty(hierarchy: Hierarchy, parent: Path) -> None:
    if parent.name != GROUP_NAME or parent in hierarchy.shared:
        return
    with contextlib.suppress(OSError):  # busy: other sandboxes' groups are in it
        parent.rmdir()


@functools.cache
def hierarchy() -> Hierarchy | str:
    """Where this host lets sandbox groups be made, else the reason it does not."""
    if os.geteuid() != 0:
        return "needs root"
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        try:
            parent = _v2_parent()
        except OSError as e:
            return f"cgroup v2 controllers unavailable: {e}"
        if parent is None:
            return "cgroup v2 without delegable memory and pids controllers"
        shared = frozenset({parent}) if parent == CGROUP_ROOT / GROUP_NAME else frozenset()
        return Hierarchy(2, {c: parent for c in ("memory", "pids", "cpu")}, shared)
    parents: dict[str, Path] = {}
    for controller in ("memory", "pids", "cpu"):
        base = CGROUP_ROOT / controller
        if not (base / "cgroup.procs").exists():
            continue
        parent = _writable_parent(base, _own_path(controller))
        if parent is not None:
            parents[controller] = parent
    if "memory" not in parents or "pids" not in parents:
        return "no writable cgroup v1 memory and pids controllers"
    shared = frozenset(p for c, p in parents.items() if p == CGROUP_ROOT / c / GROUP_NAME)
    return Hierarchy(1, parents, shared)


def availability() -> str | None:
    """``None`` when sandboxes get cgroups here, else why not."""
    found = hierarchy()
    return found if isinstance(found, str) else None


@dataclass
class SandboxCgroup:
    """One sandbox's groups (one per controller on v1, one on v2)."""

    hierarchy: Hierarchy
    dirs: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        hierarchy: Hierarchy,
        name: str,
        *,
        memory_bytes: int | None,
        pids: int | None,
        cpu_cores: float | None,
    ) -> SandboxCgroup:
        """Make the groups and write the limits (``OSError`` if the kernel refuses)."""
        group = cls(hierarchy)
        try:
            for controller, parent in hierarchy.parents.items():
                path = parent / name
                if path not in group.dirs.values():
                    for attempt in range(3):
                        _make_parent(hierarchy, parent)
                        try:
                            path.mkdir()
                            break
                        except FileNotFoundError:  # the parent's last sandbox removed it
                            if attempt == 2:
                                raise
                group.dirs[controller] = path
            group._limit(memory_bytes, pids, cpu_cores)
        except OSError:
            group.remove()
            raise
        return group

    def _write(self, controller: str, name: str, value: str) -> None:
        (self.dirs[controller] / name).write_text(value)

    def _limit(self, memory_bytes: int | None, pids: int | None, cpu: float | None) -> None:
        v2 = self.hierarchy.version == 2
        if memory_bytes is not None:
            if v2:
                self._write("memory", "memory.max", str(memory_bytes))
                # No swap: the memory limit is the sandbox's memory, RAM-backed files
                # (tmpfs) included.
                with contextlib.suppress(OSError):
                    self._write("memory", "memory.swap.max", "0")
            else:
                self._write("memory", "memory.limit_in_bytes", str(memory_bytes))
                with contextlib.suppress(OSError):  # absent without swap accounting
                    self._write("memory", "memory.memsw.limit_in_bytes", str(memory_bytes))
        if pids is not None:
            self._write("pids", "pids.max", str(pids))
        if cpu is not None and "cpu" in self.dirs:
            period = 100_000
            quota = max(1000, int(cpu * period))
            with contextlib.suppress(OSError):  # a CPU quota is a bonus, not a guarantee
                if v2:
                    self._write("cpu", "cpu.max", f"{quota} {period}")
                else:
                    self._write("cpu", "cpu.cfs_period_us", str(period))
                    self._write("cpu", "cpu.cfs_quota_us", str(quota))

    def enter_argv(self) -> list[str]:
        """Prefix that moves the command into the groups, then ``exec``\\ s the rest."""
        procs = sorted({str(d / "cgroup.procs") for d in self.dirs.values()})
        script = " && ".join(f"echo $$ > {shlex.quote(p)}" for p in procs) + ' && exec "$@"'
        return ["/bin/sh", "-c", script, "rollout-gateway-cgroup"]

    def pids(self) -> set[int]:
        """Every process (v2: and thread group) in the sandbox's groups."""
        found: set[int] = set()
        for path in set(self.dirs.values()):
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        return found

    def events(self) -> dict[str, int]:
        """Limit events so far: ``oom_kill`` (processes the kernel killed at the memory
        limit) and ``pids_max`` (forks refused at the process limit)."""
        counts = {"oom_kill": 0, "pids_max": 0}
        memory_file = "memory.events" if self.hierarchy.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.dirs["memory"] / memory_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    counts["oom_kill"] = int(value)
        with contextlib.suppress(OSError, ValueError):
            for line in (self.dirs["pids"] / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    counts["pids_max"] = int(value)
        return counts

    def kill_all(self, settle_s: float = 2.0) -> bool:
        """SIGKILL every process in the groups until none is left; ``True`` when empty.

        Repeated until empty: a process forking while it is being killed leaves a child
        in the group, which the next pass kills (the pids limit bounds each pass).
        """
        deadline = time.monotonic() + settle_s
        while True:
            if self.hierarchy.version == 2:
                for path in set(self.dirs.values()):
                    with contextlib.suppress(OSError):  # absent before Linux 5.14
                        (path / "cgroup.kill").write_text("1")
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() >= deadline:
                return not self.pids()
            time.sleep(0.01)

    def remove(self) -> None:
        """Kill what is left and remove the groups (idempotent)."""
        if self.pids():
            self.kill_all()
        for path in set(self.dirs.values()):
            for _ in range(50):  # a killed process leaves its group a moment later
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            _remove_if_empty(self.hierarchy, path.parent)
        self.dirs.clear()

    def paths(self) -> list[str]:
        """The groups' directories (recorded with the sandbox for the stale sweep)."""
        return sorted({str(d) for d in self.dirs.values()})


def sweep(sandbox_name: str, recorded: object = ()) -> None:
    """Kill and remove the groups of a sandbox whose owner is gone (stale sweep).

    ``recorded``: the group directories its owner recorded (:meth:`SandboxCgroup.paths`).
    A group made under the owner's own group is found only there (this process may sit
    in another group); the groups this process would make for that name are swept too.
    A recorded path is used only when it is a ``rollout-gateway/<sandbox_name>`` group
    of a mounted hierarchy.
    """
    found = hierarchy()
    if isinstance(found, str):
        return
    group = SandboxCgroup(found)
    candidates = {c: parent / sandbox_name for c, parent in found.parents.items()}
    if isinstance(recorded, (list, tuple)):
        paths = [Path(p) for p in recorded if isinstance(p, str)]
        candidates.update((f"recorded {i}", path) for i, path in enumerate(paths))
    for key, path in candidates.items():
        if _is_sandbox_group(path, sandbox_name) and path.is_dir():
            group.dirs[key] = path
    if group.dirs:
        group.remove()


def _is_sandbox_group(path: Path, sandbox_name: str) -> bool:
    if ".." in path.parts or not path.is_absolute():
        return False
    return (
        path.name == sandbox_name
        and path.parent.name == GROUP_NAME
        and path.is_relative_to(CGROUP_ROOT)
        and not path.is_symlink()
    )


__all__ = ["Hierarchy", "SandboxCgroup", "availability", "hierarchy", "sweep"]
