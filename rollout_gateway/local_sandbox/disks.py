"""A size-bounded file system per sandbox: its disk limit, enforced by the kernel.

On a root host with loop devices and ``mkfs.ext4``, a sandbox's directory
(``<root>/<id>``) is the mount point of its own ext4 file system, backed by a sparse image
of the sandbox's ``disk_size_gb`` beside it (``<root>/.<id>.disk``, root-only 0600). Everything the
sandbox writes (its working and temp directories) is on it, so a full disk is ``ENOSPC``
for the sandbox alone; the image grows only with what is written and is deleted with the
sandbox. Elsewhere :func:`availability` says why not, and the disk limit is applied by
the watchdog instead (usage measured, the sandbox stopped when over, see
:mod:`~rollout_gateway.local_sandbox.limits`) plus the per-file size rlimit.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_MKFS_OPTIONS = ["-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1"]


def _run(argv: list[str]) -> None:
    done = subprocess.run(
        argv,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(f"{os.path.basename(argv[0])}: {err[-1] if err else done.returncode}")


def _tools() -> tuple[str, str, str] | None:
    path = "/usr/sbin:/usr/bin:/sbin:/bin"
    found = [shutil.which(n, path=path) for n in ("mkfs.ext4", "mount", "umount")]
    if any(p is None for p in found):
        return None
    return found[0], found[1], found[2]  # type: ignore[return-value]


@functools.cache
def availability() -> str | None:
    """``None`` when sandboxes get their own file system here, else why not (probed once
    by making, mounting and removing a small one)."""
    if os.geteuid() != 0:
        return "needs root (loop-mounted file system)"
    if _tools() is None:
        return "mkfs.ext4/mount not installed"
    probe = Path(tempfile.mkdtemp(prefix="rollout-gateway-disk-probe-"))
    try:
        mount_point = probe / "mnt"
        mount_point.mkdir()
        create(probe / "image", mount_point, 16 * 1024 * 1024)
        remove(probe / "image", mount_point)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot mount a loop file system here ({e})"
    finally:
        with contextlib.suppress(OSError):
            remove(probe / "image", probe / "mnt")
        shutil.rmtree(probe, ignore_errors=True)
    return None


def create(image: Path, mount_point: Path, size_bytes: int) -> None:
    """Make a sparse ext4 image of ``size_bytes`` and mount it (``nosuid,nodev``) on
    ``mount_point``."""
    tools = _tools()
    if tools is None:
        raise OSError("mkfs.ext4/mount not installed")
    mkfs, mount, _ = tools
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.truncate(max(size_bytes, 8 * 1024 * 1024))  # ext4's practical minimum
    _run([mkfs, *_MKFS_OPTIONS, str(image)])
    _run([mount, "-o", "loop,nosuid,nodev,noatime", str(image), str(mount_point)])


def mounted(mount_point: Path) -> bool:
    """Whether ``mount_point`` has a file system mounted on it."""
    return os.path.ismount(mount_point)


def remove(image: Path, mount_point: Path) -> None:
    """Unmount (lazily if still busy: the loop device goes when the last user does) and
    delete the image; idempotent."""
    tools = _tools()
    if tools is not None and mounted(mount_point):
        try:
            _run([tools[2], str(mount_point)])
        except OSError:
            _run([tools[2], "-l", str(mount_point)])
    image.unlink(missing_ok=True)


def usage_bytes(path: Path) -> int:
    """Bytes allocated under ``path`` (not following symlinks; what ``du`` counts)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def free_bytes(mount_point: Path) -> int:
    """Bytes still free on the sandbox's own file system."""
    info = os.statvfs(mount_point)
    return info.f_bavail * info.f_frsize


__all__ = ["availability", "create", "free_bytes", "mounted", "remove", "usage_bytes"]
