"""A size-bounded file system per sandbox: its disk limit, enforced by the kernel.

On a root host with loop devices and ``mkfs.ext4``, a sandbox's directory
(``<root>/<id>``) is the mount point of its own ext4 file system, backed by a sparse image
of the sandbox's ``disk_size_gb`` beside it (``<root>/.<id>.disk``, root-only 0600). Everything the
sandbox writes (its working and temp directories) is on it, so a full disk is ``ENOSPC``
for the sandbox alone; the image grows only with what is written and is deleted with the
sandbox. Elsewhere :func:`availability` says why not, and the disk limit is applied by
the watchdog instead (usage measured, the sandbox stopped when over, see
:mod:`~rollout_gateway.local_sandbox.limits`) plus the per-file size rlimit.

Every disk made here is recorded, machine-wide, in ``/run/rollout-gateway/disks/``
(root-only; ``/run`` forgets at boot what mounts forget too): one file per disk naming its
image and mount point, locked with ``flock`` by the process that made it from before the
image exists until :func:`remove`. A process killed with ``kill -9`` (a demo stopped mid-
setup, a test run timed out) drops its locks; :func:`sweep_abandoned` (run by every
client's stale sweep, whatever its root) then unmounts and deletes what those records
name, and only that: a record it did not write (not a regular file owned by this uid), a
mount point whose file system is not a loop mount of the recorded image, an image not a
regular file of this uid, are left alone. Disks under a sandbox root no client will open
again (pytest's temporary directories) are found this way too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

#: Where the records of the disks made on this machine live (see the module doc).
RECORDS_DIR = Path("/run/rollout-gateway/disks")
#: Another directory for the records (a test's own, so its sweep sees only its disks).
RECORDS_ENV = "ROLLOUT_GATEWAY_DISK_RECORDS"

# mount point -> (record path, the fd holding its lock), for the disks made by this process.
_held: dict[str, tuple[Path, int]] = {}
_held_lock = threading.Lock()

_PROBE_PREFIX = "rollout-gateway-disk-probe-"
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
    probe = Path(tempfile.mkdtemp(prefix=_PROBE_PREFIX))
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
    ``mount_point``, recorded (and the record held) until :func:`remove`."""
    tools = _tools()
    if tools is None:
        raise OSError("mkfs.ext4/mount not installed")
    mkfs, mount, _ = tools
    image, mount_point = Path(os.path.abspath(image)), Path(os.path.abspath(mount_point))
    _record(image, mount_point)  # before the image exists: a kill from here on is swept
    try:
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.truncate(max(size_bytes, 8 * 1024 * 1024))  # ext4's practical minimum
        _run([mkfs, *_MKFS_OPTIONS, str(image)])
        _run([mount, "-o", "loop,nosuid,nodev,noatime", str(image), str(mount_point)])
    except BaseException:
        if not mounted(mount_point):  # nothing mounted: the caller removes the image
            _release(mount_point)
        raise


def mounted(mount_point: Path) -> bool:
    """Whether ``mount_point`` has a file system mounted on it."""
    return os.path.ismount(mount_point)


def remove(image: Path, mount_point: Path) -> None:
    """Unmount (lazily if still busy: the loop device goes when the last user does) and
    delete the image; idempotent."""
    _unmount(mount_point)
    image.unlink(missing_ok=True)
    _release(Path(os.path.abspath(mount_point)))


def _unmount(mount_point: Path) -> None:
    tools = _tools()
    if tools is not None and mounted(mount_point):
        try:
            _run([tools[2], str(mount_point)])
        except OSError:
            _run([tools[2], "-l", str(mount_point)])


def records_dir() -> Path:
    """The directory of the disk records (``$ROLLOUT_GATEWAY_DISK_RECORDS`` or
    :data:`RECORDS_DIR`), created root-only; refused unless a directory of this uid."""
    path = Path(os.environ.get(RECORDS_ENV) or RECORDS_DIR)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise OSError(f"{path} is not a directory owned by uid {os.geteuid()}")
    return path


def _record(image: Path, mount_point: Path) -> None:
    """Write and lock the record of a disk about to be made (written under a temporary
    name, locked, then renamed: a sweep never sees a record before its lock is held)."""
    records = records_dir()
    name = secrets.token_hex(8)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(records / f".{name}.tmp", flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"image": str(image), "mount_point": str(mount_point)}).encode())
        os.replace(records / f".{name}.tmp", records / f"{name}.json")
    except BaseException:
        os.close(fd)
        (records / f".{name}.tmp").unlink(missing_ok=True)
        raise
    with _held_lock:
        _held[str(mount_point)] = (records / f"{name}.json", fd)


def _release(mount_point: Path) -> None:
    with _held_lock:
        held = _held.pop(str(mount_point), None)
    if held is not None:
        held[0].unlink(missing_ok=True)
        os.close(held[1])  # drops the lock


def sweep_abandoned() -> list[str]:
    """Unmount and delete the disks whose maker is gone (see the module doc); the mount
    points cleaned. Idempotent; never raises for one disk (it is logged and kept)."""
    try:
        records = records_dir()
        entries = sorted(records.iterdir())
    except OSError:
        return []
    cleaned: list[str] = []
    for entry in entries:
        if entry.suffix != ".json" or entry.name.startswith("."):
            continue
        try:
            disk = _abandoned(entry)
            if disk is None:
                continue
            _clean(*disk)
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("could not remove the abandoned disk of %s: %s", entry, e)
            continue
        entry.unlink(missing_ok=True)
        cleaned.append(str(disk[1]))
    if cleaned:
        logger.info("Removed %d abandoned sandbox disk(s): %s", len(cleaned), cleaned)
    return cleaned


def _abandoned(entry: Path) -> tuple[Path, Path] | None:
    """The (image, mount point) of a record whose maker is gone, else ``None``."""
    fd = os.open(entry, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its maker is alive
        record = json.loads(os.read(fd, 1 << 16) or b"{}")
    finally:
        os.close(fd)
    image, mount_point = record.get("image"), record.get("mount_point")
    if not (isinstance(image, str) and isinstance(mount_point, str)):
        return None
    if not (os.path.isabs(image) and os.path.isabs(mount_point)):
        return None
    return Path(image), Path(mount_point)


def _clean(image: Path, mount_point: Path) -> None:
    """Unmount ``mount_point`` if a loop mount of ``image`` is there; delete ``image`` if
    it is a regular file of this uid; remove the emptied mount point."""
    if mounted(mount_point) and _loop_source(mount_point) == str(image):
        shutil.rmtree(mount_point, ignore_errors=True)  # its content, before the mount goes
        _unmount(mount_point)
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(image)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            image.unlink()
    if not mounted(mount_point):
        with contextlib.suppress(OSError):
            mount_point.rmdir()  # only when empty
            if mount_point.parent.name.startswith(_PROBE_PREFIX):
                mount_point.parent.rmdir()  # availability()'s probe directory, emptied


def _loop_source(mount_point: Path) -> str | None:
    """The backing file of the loop device mounted on ``mount_point`` (``None`` when what
    is mounted there is no loop device)."""
    target = os.path.realpath(mount_point)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    source = None
    for line in lines:  # the last mount on a point is the one seen
        fields = line.split()
        if len(fields) > 4 and _unescape(fields[4]) == target and " - " in line:
            source = line.split(" - ", 1)[1].split()[1]
    if source is None or not source.startswith("/dev/loop"):
        return None
    try:
        backing = Path(f"/sys/block/{os.path.basename(source)}/loop/backing_file").read_text()
    except OSError:
        return None
    return backing.strip().removesuffix(" (deleted)")


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


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


__all__ = [
    "RECORDS_DIR",
    "RECORDS_ENV",
    "availability",
    "create",
    "free_bytes",
    "mounted",
    "records_dir",
    "remove",
    "sweep_abandoned",
    "usage_bytes",
]
