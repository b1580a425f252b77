"""Where a local sandbox lives on disk, who owns what, and the sweep of stale sandboxes.

``<root>/<sandbox_id>/`` (host-owned, 0711: traversable, not listable) holds:

- ``work/`` and ``tmp/``: the sandbox's working directory (``HOME``) and ``TMPDIR``,
  owned by the sandbox's uid, mode 0700; the only places a sandbox can write.
- ``.state/``: host-owned, 0700: ``lock`` (held with ``flock`` by the owning client for
  the sandbox's lifetime), ``meta.json`` (its uid, mode and cgroup directories) and command logs.

The stale sweep trusts nothing a sandbox can write: a sandbox is stale when its ``lock``
can be taken (its owner is gone: the kernel dropped the lock), and only host-owned,
non-symlink entries with a well-formed id are considered. A sandbox being created has no
``.state/`` yet (its own file system is mounted on ``<sandbox_id>/`` first, hiding what
was there): ``<root>/.<sandbox_id>.creating``, locked by the creating client from before
the directory exists until ``.state/lock`` is held, says whether its creator is alive, so
a client killed mid-creation (``kill -9``) leaves nothing the sweep misses (a mounted
disk, its loop device, its image).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_gateway.local_sandbox import cgroups, disks, processes, uids
from rollout_gateway.local_sandbox.errors import SandboxRootError

logger = logging.getLogger(__name__)

SANDBOX_ID = re.compile(r"^local-[0-9a-f]{20}$")


@dataclass(frozen=True)
class SandboxDirs:
    """The directories of one sandbox."""

    base: Path

    @property
    def work(self) -> Path:
        return self.base / "work"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"

    @property
    def state(self) -> Path:
        return self.base / ".state"


def prepare_root(root: Path, shared_with_uids: bool) -> Path:
    """Create the sandbox root; 0711 when per-sandbox uids must traverse it.

    Raises :class:`SandboxRootError` (saying what to do) when it cannot be created or
    written, or when the sandboxes' uids could not reach it.
    """
    how = "choose another root ($ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT)"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        root = root.resolve()
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(f"{root} is not writable")
        if shared_with_uids:
            mode = stat.S_IMODE(os.stat(root).st_mode)
            if mode & 0o001 == 0:  # searchable by others; never loosen anything else
                os.chmod(root, mode | 0o011)
    except OSError as e:
        raise SandboxRootError(
            f"cannot use sandbox root {root}: {e.strerror or e}; {how}", root=str(root)
        ) from e
    if shared_with_uids:
        for parent in root.parents:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                raise SandboxRootError(
                    f"sandbox root {root} is not reachable by the sandboxes' uids: {parent} "
                    f"is not searchable by others; {how}",
                    root=str(root),
                )
    return root


def create_dirs(
    dirs: SandboxDirs,
    owner: tuple[int, int] | None,
    meta: dict[str, Any],
    traversable: bool,
    mount: Callable[[Path], None] | None = None,
) -> int:
    """Create a sandbox's directories and metadata; return the fd holding its lock.

    ``traversable``: the sandbox's uid reaches ``work`` through the host path (no mount
    namespace), so ``base`` must be searchable by others. ``mount``: called on the empty
    ``base`` first (the sandbox's own file system goes there).
    """
    creating = _creating(dirs.base)
    guard = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        dirs.base.mkdir(mode=0o700)
        if mount is not None:
            mount(dirs.base)
        os.chmod(dirs.base, 0o711 if traversable else 0o700)
        dirs.state.mkdir(mode=0o700)
        lock_fd = os.open(dirs.state / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        creating.unlink(missing_ok=True)
        os.close(guard)
    write_meta(dirs, meta)
    for path in (dirs.work, dirs.tmp):
        path.mkdir(mode=0o700)
        if owner is not None:
            os.chown(path, *owner)
    return lock_fd


def write_meta(dirs: SandboxDirs, meta: dict[str, Any]) -> None:
    """(Re)write a sandbox's host-written metadata (what the stale sweep reads)."""
    tmp = dirs.state / "meta.json.tmp"
    tmp.write_text(json.dumps(meta))
    tmp.replace(dirs.state / "meta.json")


def chown_tree(path: Path, owner: tuple[int, int]) -> None:
    """Give a seeded tree to the sandbox's uid (symlinks themselves, never their targets)."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), *owner)
    os.lchown(path, *owner)


def _creating(base: Path) -> Path:
    """The lock a client holds while it creates ``base`` (see the module doc)."""
    return base.parent / f".{base.name}.creating"


def _abandoned_creation(base: Path) -> bool:
    """Whether ``base`` (no ``.state/`` yet) was being created by a client now gone."""
    try:
        fd = os.open(_creating(base), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no creation under way, or it finished and ``.state/`` is there now
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its creator is alive
    finally:
        os.close(fd)
    # Locked after its creator let go: stale, unless the creation finished meanwhile.
    return not os.path.lexists(base / ".state")


def _stale(base: Path) -> dict[str, Any] | None:
    """The host-written metadata of ``base`` when it is a stale sandbox, else ``None``."""
    if not SANDBOX_ID.fullmatch(base.name):
        return None
    try:
        info = os.lstat(base)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return None
        if not os.path.lexists(base / ".state"):
            return {} if _abandoned_creation(base) else None
        state = os.lstat(base / ".state")
        if not stat.S_ISDIR(state.st_mode) or state.st_uid != os.geteuid():
            return None
        fd = os.open(base / ".state" / "lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None  # its owner still holds it
    finally:
        os.close(fd)
    try:
        meta = json.loads((base / ".state" / "meta.json").read_text())
    except (OSError, ValueError):
        meta = {}
    return meta if isinstance(meta, dict) else {}


def disk_image(root: Path, sandbox_id: str) -> Path:
    """Where a sandbox's file-system image lives: beside its directory, root-only (0600)."""
    return root / f".{sandbox_id}.disk"


def remove_base(root: Path, base: Path) -> None:
    """Remove a sandbox's directory: its own file system unmounted, its image deleted."""
    if disks.mounted(base):
        shutil.rmtree(base, ignore_errors=True)  # its content, before the mount goes
        with contextlib.suppress(OSError):
            disks.remove(disk_image(root, base.name), base)
    else:
        disk_image(root, base.name).unlink(missing_ok=True)
    shutil.rmtree(base, ignore_errors=True)


def sweep_stale(root: Path) -> list[str]:
    """Kill and remove every sandbox in ``root`` whose owning client is gone."""
    removed: list[str] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for base in entries:
        meta = _stale(base)
        if meta is None:
            continue
        uid = meta.get("uid")
        if isinstance(uid, int) and uids.is_sandbox_uid(uid) and not uids.uid_is_claimed(uid):
            uids.kill_uid(uid)
        elif meta.get("mode") == "process-group":
            processes.kill_marked(base.name, ())
        cgroups.sweep(base.name, meta.get("cgroups", ()))
        remove_base(root, base)
        removed.append(base.name)
    # Images whose sandbox directory is already gone (a crash between the two removals),
    # and the creation locks of creations that died before making the directory.
    for entry in entries:
        name = entry.name
        for suffix in (".disk", ".creating"):
            if name.startswith(".") and name.endswith(suffix):
                sandbox_id = name[1 : -len(suffix)]
                if SANDBOX_ID.fullmatch(sandbox_id) and not (root / sandbox_id).exists():
                    if suffix == ".disk" or _abandoned_creation(root / sandbox_id):
                        entry.unlink(missing_ok=True)
    if removed:
        logger.info("Removed %d stale local sandbox(es) from %s", len(removed), root)
    disks.sweep_abandoned()  # and the disks of dead clients under any other root
    return removed


__all__ = [
    "SANDBOX_ID",
    "SandboxDirs",
    "chown_tree",
    "create_dirs",
    "disk_image",
    "prepare_root",
    "remove_base",
    "sweep_stale",
    "write_meta",
]
