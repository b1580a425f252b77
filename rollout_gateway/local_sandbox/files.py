"""The file API's path handling: a sandbox path can never lead out of the sandbox.

The agent controls everything under its working directory, including symlinks and hard
links, and the host (often root) does the reads and writes. So a path is opened one
component at a time from a trusted directory fd with ``O_NOFOLLOW`` (``openat``-style):
a symlink anywhere on the path, or ``..``, fails instead of being followed. Files the
sandbox owns are checked to be owned by its uid (a hard link to a host file is not).
All functions block: call them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PathOutsideSandboxError(ValueError):
    """A file-API path names something outside the sandbox (or goes through a symlink)."""


@dataclass(frozen=True)
class Anchor:
    """A directory a sandbox path may start from, and who must own what is under it."""

    path: Path
    owner_uid: int | None  # None: do not check ownership


def split_path(
    file_path: str, default: Anchor, anchors: list[Anchor]
) -> tuple[Anchor, tuple[str, ...]]:
    """Map a file-API path to (anchor, components).

    Relative paths start at ``default`` (the working directory); absolute paths must lie
    under one of ``anchors``. ``..`` and empty paths are refused.
    """
    if "\0" in file_path:
        raise PathOutsideSandboxError("path contains a NUL byte")
    path = PurePosixPath(file_path)
    if not path.is_absolute():
        anchor, rest = default, path.parts
    else:
        for candidate in anchors:
            try:
                rest = path.relative_to(candidate.path).parts
            except ValueError:
                continue
            anchor = candidate
            break
        else:
            raise PathOutsideSandboxError(f"{file_path!r} is outside the sandbox")
    parts = tuple(p for p in rest if p not in ("", "."))
    if ".." in parts:
        raise PathOutsideSandboxError(f"{file_path!r} contains '..'")
    if not parts:
        raise PathOutsideSandboxError(f"{file_path!r} names a directory, not a file")
    return anchor, parts


@contextlib.contextmanager
def _open_parent(
    anchor: Anchor, parts: tuple[str, ...], *, create: bool, chown: tuple[int, int] | None
) -> Iterator[int]:
    """Yield an fd of the directory holding ``parts[-1]``, walked with ``O_NOFOLLOW``."""
    fd = os.open(anchor.path, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                if chown is not None:
                    os.fchown(child, *chown)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathOutsideSandboxError(
                        f"{'/'.join(parts)!r}: {name!r} is a symlink or not a directory"
                    ) from None
                raise
            _check_owner(child, anchor, "/".join(parts))
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _check_owner(fd: int, anchor: Anchor, shown: str) -> os.stat_result:
    info = os.fstat(fd)
    if anchor.owner_uid is not None and info.st_uid != anchor.owner_uid:
        raise PathOutsideSandboxError(f"{shown!r} is not the sandbox's own file")
    return info


def _open_leaf(dir_fd: int, name: str, flags: int, shown: str, mode: int = 0o644) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PathOutsideSandboxError(f"{shown!r} is a symlink") from None
        raise


def write_file(
    anchor: Anchor, parts: tuple[str, ...], data: bytes, chown: tuple[int, int] | None
) -> int:
    """Create or replace a file (parents created, owned by ``chown``); returns its size."""
    shown = "/".join(parts)
    with _open_parent(anchor, parts, create=True, chown=chown) as dir_fd:
        fd = _open_leaf(dir_fd, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, shown)
        try:
            info = _check_owner(fd, anchor, shown) if chown is None else os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise PathOutsideSandboxError(f"{shown!r} is not a regular file")
            if chown is not None:
                if info.st_uid not in (chown[0], os.geteuid()) or info.st_nlink > 1:
                    raise PathOutsideSandboxError(f"{shown!r} is not the sandbox's own file")
                os.fchown(fd, *chown)
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    return len(data)


@contextlib.contextmanager
def open_for_read(anchor: Anchor, parts: tuple[str, ...]) -> Iterator[tuple[int, int]]:
    """Yield (fd, size) of a regular file; ``FileNotFoundError`` when missing."""
    shown = "/".join(parts)
    with _open_parent(anchor, parts, create=False, chown=None) as dir_fd:
        fd = _open_leaf(dir_fd, parts[-1], os.O_RDONLY | os.O_NONBLOCK, shown)
        try:
            info = _check_owner(fd, anchor, shown)
            if not stat.S_ISREG(info.st_mode):
                raise FileNotFoundError(errno.ENOENT, "not a regular file", shown)
            yield fd, info.st_size
        finally:
            os.close(fd)


def read_window(fd: int, offset: int, length: int) -> bytes:
    """Read up to ``length`` bytes at ``offset``."""
    chunks: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, min(length, 1 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


__all__ = [
    "Anchor",
    "PathOutsideSandboxError",
    "open_for_read",
    "read_window",
    "split_path",
    "write_file",
]
