"""The demo's run directory: created only once preflight passed, ``metadata.json`` in it
rewritten atomically, and held by one demo at a time.

``metadata.json`` is the demo's record of the run (both stacks): the stack, the settings
(what ``--resume`` reuses), versions, isolation, status, counts, the original start time
and one entry per resume. The classic stack adds vf-eval's keys to it; the stack's own
files sit beside it (:mod:`.stack`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import tempfile
import time
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from rollout_gateway.demo.options import DEFAULT_OUTPUT_ROOT, DemoError

METADATA_FILE = "metadata.json"


def versions() -> dict[str, str]:
    """Versions of the packages a result depends on."""
    found = {"python": platform.python_version()}
    for dist in ("rollout-gateway", "verifiers", "prime-sandboxes", "openai"):
        try:
            found[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def now_iso() -> str:
    """Current UTC time, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def default_output() -> Path:
    """``outputs/demo-<date>-<time>``, with a suffix when that name is taken."""
    base = DEFAULT_OUTPUT_ROOT / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_new(path: Path) -> None:
    """Preflight of ``--output``: creatable and not holding results (creates nothing)."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DemoError(
            f"--output {path} already exists and is not an empty directory "
            f"(use --resume {path} to continue a run, or another --output)"
        )
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DemoError(f"cannot create the output directory {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DemoError(f"cannot create the output directory {path}: {existing} is not writable")


def read_metadata(path: Path) -> dict[str, Any]:
    """An existing run's ``metadata.json`` (``DemoError`` naming ``--resume`` if unusable)."""
    if not path.is_dir():
        raise DemoError(f"--resume {path}: no such directory")
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except FileNotFoundError:
        raise DemoError(f"--resume {path}: no {METADATA_FILE} (not a demo run)") from None
    except (OSError, ValueError) as e:
        raise DemoError(f"--resume {path}: cannot read {METADATA_FILE}: {e}") from None
    if not isinstance(meta, dict):
        raise DemoError(f"--resume {path}: {METADATA_FILE} is not a JSON object")
    return meta


class RunDir:
    """A run directory this process holds (an exclusive lock on the directory itself, so
    two demos never write one run; released when the process ends, however it ends)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata_path = path / METADATA_FILE
        self._lock_fd: int | None = None

    @classmethod
    def create(cls, path: Path) -> RunDir:
        """A new directory (after :func:`check_new` passed)."""
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DemoError(f"cannot create the output directory {path}: {e.strerror}") from e
        run = cls(path)
        run.lock()
        return run

    @classmethod
    def open(cls, path: Path) -> RunDir:
        """An existing run's directory (``--resume``), checked writable."""
        run = cls(path)
        run.lock()
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
                pass
        except OSError as e:
            run.unlock()
            raise DemoError(f"--resume {path}: cannot write there: {e.strerror or e}") from e
        return run

    def lock(self) -> None:
        """Take the directory's lock (``DemoError`` if another demo holds it)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DemoError(f"{self.path}: another demo is running in this directory") from None
        self._lock_fd = fd

    def unlock(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def write_metadata(self, meta: dict[str, Any]) -> None:
        """Replace ``metadata.json`` atomically (a reader never sees half of it)."""
        tmp = self.metadata_path.with_name(f".{METADATA_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, self.metadata_path)

    def listing(self) -> list[str]:
        """The directory's files, relative, sorted (what the summary shows)."""
        return sorted(
            str(p.relative_to(self.path)) + ("/" if p.is_dir() and not p.is_symlink() else "")
            for p in self.path.rglob("*")
            if not p.name.startswith(".")
        )


__all__ = [
    "METADATA_FILE",
    "RunDir",
    "check_new",
    "default_output",
    "now_iso",
    "read_metadata",
    "versions",
]
