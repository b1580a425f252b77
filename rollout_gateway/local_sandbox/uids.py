"""Per-sandbox unprivileged uids (root hosts): claiming one, and killing all it runs.

A uid is claimed by holding an exclusive ``flock`` on ``<claims>/<uid>.lock`` for the
sandbox's lifetime; the kernel drops the lock when the holder dies, so a crashed run's
uids become free again without trusting any pid written anywhere. The claims directory
lives under ``/run`` (root-only), never where a sandbox could write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import secrets
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: First uid handed to sandboxes, and how many there are. Far above any real account.
UID_BASE = 1_900_000_000
UID_SPAN = 65_536
CLAIMS_DIR = Path("/run/rollout-gateway/uids")


def is_sandbox_uid(uid: int) -> bool:
    """Whether ``uid`` is in the sandbox range (never root, never a real account)."""
    return UID_BASE <= uid < UID_BASE + UID_SPAN


@dataclass
class UidLease:
    """A claimed uid (its gid has the same number); :meth:`release` frees it."""

    uid: int
    fd: int | None

    @property
    def gid(self) -> int:
        return self.uid

    def release(self) -> None:
        """Kill what still runs as the uid, then drop the claim (idempotent)."""
        kill_uid(self.uid)
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # drops the flock


def _claims_dir() -> Path:
    CLAIMS_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.lstat(CLAIMS_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise RuntimeError(f"{CLAIMS_DIR} is not a directory owned by uid {os.geteuid()}")
    return CLAIMS_DIR


def claim_uid(attempts: int = 200) -> UidLease:
    """Claim a free sandbox uid (random in the range; blocking: call off the event loop)."""
    claims = _claims_dir()
    for _ in range(attempts):
        uid = UID_BASE + secrets.randbelow(UID_SPAN)
        try:
            pwd.getpwuid(uid)
            continue  # a real account: never reuse it
        except KeyError:
            pass
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(claims / f"{uid}.lock", flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        kill_uid(uid)  # leftovers of a crashed owner: the uid is ours now
        return UidLease(uid=uid, fd=fd)
    raise RuntimeError("no free sandbox uid (all tried are in use)")


def uid_is_claimed(uid: int) -> bool:
    """Whether a live process holds the claim on ``uid``."""
    path = CLAIMS_DIR / f"{uid}.lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def uid_pids(uid: int) -> set[int]:
    """Live (non-zombie) processes whose real, effective or saved uid is ``uid``."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        state = uids = None
        for line in status.splitlines():
            if line.startswith(b"State:"):
                state = line.split()[1:2]
            elif line.startswith(b"Uid:"):
                uids = {int(x) for x in line.split()[1:4]}
        if uids and uid in uids and state != [b"Z"]:
            found.add(int(name))
    return found


def kill_uid(uid: int, settle_s: float = 2.0) -> bool:
    """SIGKILL every process running as sandbox uid ``uid``; ``True`` once none is left.

    The signal is sent by a helper that has dropped to ``uid`` first and calls
    ``kill(-1, SIGKILL)``: the kernel then signals every process that uid owns in one
    pass, which a forking process cannot outrun. Blocking: call off the event loop.
    """
    if not is_sandbox_uid(uid):  # never signal as root or as a real account
        raise ValueError(f"refusing to kill uid {uid}: not a sandbox uid")
    deadline = time.monotonic() + settle_s
    while True:
        pids = uid_pids(uid)
        if not pids:
            return True
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["/bin/sh", "-c", "kill -9 -1"],
                user=uid,
                group=uid,
                extra_groups=[],
                env={"PATH": "/usr/bin:/bin"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=5,
                check=False,
            )
        if time.monotonic() >= deadline:
            return not uid_pids(uid)
        time.sleep(0.01)


__all__ = [
    "CLAIMS_DIR",
    "UID_BASE",
    "UID_SPAN",
    "UidLease",
    "claim_uid",
    "is_sandbox_uid",
    "kill_uid",
    "uid_is_claimed",
    "uid_pids",
]
