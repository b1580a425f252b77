"""prime-sandboxes' file methods (upload, download, read) for local sandboxes.

Every path goes through :mod:`rollout_gateway.local_sandbox.files`: relative paths resolve
in the working directory, absolute ones only inside the sandbox's own directories, and no
symlink or ``..`` is ever followed out of it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from prime_sandboxes import (
    APIError,
    FileUploadResponse,
    ReadFileResponse,
    SandboxFileNotFoundError,
    SandboxFileTooLargeError,
)

from rollout_gateway.local_sandbox import files
from rollout_gateway.local_sandbox.isolation import IsolationMode
from rollout_gateway.local_sandbox.sandbox import LocalSandbox


def _in_slash_tmp(file_path: str, anchors: list[files.Anchor]) -> bool:
    """Whether ``file_path`` is under ``/tmp`` and under none of the sandbox's own
    directories (which may lie under the host's ``/tmp`` themselves)."""
    if not (file_path + "/").startswith("/tmp/"):
        return False
    return not any((file_path + "/").startswith(f"{a.path}/") for a in anchors)


class SandboxFileAPI:
    """The file half of :class:`~rollout_gateway.local_sandbox.LocalSandboxClient`."""

    _max_read_bytes: int

    async def _running(self, sandbox_id: str, command: str | None = None) -> LocalSandbox:
        raise NotImplementedError

    def _locate(self, sb: LocalSandbox, file_path: str) -> tuple[files.Anchor, tuple[str, ...]]:
        default, anchors = sb.anchors()
        if sb.mode is IsolationMode.BWRAP and _in_slash_tmp(file_path, anchors):
            # bwrap mounts the sandbox's temp directory at /tmp (isolation.bwrap_argv).
            file_path = str(sb.dirs.tmp) + file_path[len("/tmp") :]
        try:
            return files.split_path(file_path, default, anchors)
        except files.PathOutsideSandboxError as e:
            raise APIError(f"HTTP 403: local sandbox {sb.id}: {e}") from None

    async def _file_op(self, sb: LocalSandbox, fn: Callable[[], Any], what: str) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except files.PathOutsideSandboxError as e:
            raise APIError(f"HTTP 403: local sandbox {sb.id}: {e}") from None
        except (APIError, SandboxFileNotFoundError, SandboxFileTooLargeError):
            raise
        except OSError as e:  # the real client wraps transport/server failures in APIError
            raise APIError(f"{what} failed: {e.__class__.__name__}: {e}") from e

    async def upload_file(
        self,
        sandbox_id: str,
        file_path: str,
        local_file_path: str,
        timeout: int | None = None,
    ) -> FileUploadResponse:
        """Copy a host file into the sandbox (parents created)."""
        if not os.path.exists(local_file_path):
            raise FileNotFoundError(f"Local file not found: {local_file_path}")

        def read_local() -> bytes:
            with open(local_file_path, "rb") as f:
                return f.read()

        data = await asyncio.to_thread(read_local)
        return await self.upload_bytes(sandbox_id, file_path, data, os.path.basename(file_path))

    async def upload_bytes(
        self,
        sandbox_id: str,
        file_path: str,
        file_bytes: bytes,
        filename: str,
        timeout: int | None = None,
    ) -> FileUploadResponse:
        """Write ``file_bytes`` to ``file_path`` in the sandbox (parents created)."""
        sb = await self._running(sandbox_id)
        anchor, parts = self._locate(sb, file_path)
        size = await self._file_op(
            sb, lambda: files.write_file(anchor, parts, file_bytes, sb.owner), "Upload"
        )
        return FileUploadResponse(
            success=True, path=file_path, size=size, timestamp=datetime.now(UTC)
        )

    async def download_file(
        self,
        sandbox_id: str,
        file_path: str,
        local_file_path: str,
        timeout: int | None = None,
    ) -> None:
        """Copy a sandbox file to the host."""
        sb = await self._running(sandbox_id)
        anchor, parts = self._locate(sb, file_path)

        def copy() -> None:
            try:
                with files.open_for_read(anchor, parts) as (fd, size):
                    data = files.read_window(fd, 0, size)
            except FileNotFoundError:
                raise APIError(f"Download failed: HTTP 404: {file_path} not found") from None
            parent = os.path.dirname(local_file_path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(local_file_path, "wb") as f:
                f.write(data)

        await self._file_op(sb, copy, "Download")

    async def read_file(
        self,
        sandbox_id: str,
        file_path: str,
        timeout: int | None = None,
        offset: int | None = None,
        length: int | None = None,
    ) -> ReadFileResponse:
        """Read a text file (or a byte window of it) from the sandbox.

        Raises ``SandboxFileNotFoundError`` when missing and ``SandboxFileTooLargeError``
        when larger than ``max_read_bytes`` and no window is given.
        """
        sb = await self._running(sandbox_id)
        anchor, parts = self._locate(sb, file_path)
        limit = self._max_read_bytes

        def read() -> ReadFileResponse:
            try:
                with files.open_for_read(anchor, parts) as (fd, total):
                    if length is None and offset is None and total > limit:
                        raise SandboxFileTooLargeError(f"File too large to read: {file_path}")
                    start = offset or 0
                    data = files.read_window(fd, start, length if length is not None else limit)
            except (FileNotFoundError, NotADirectoryError):
                raise SandboxFileNotFoundError(f"File not found: {file_path}") from None
            windowed = offset is not None or length is not None
            return ReadFileResponse(
                content=data.decode("utf-8", errors="replace"),
                size=len(data),
                total_size=total,
                offset=start if windowed else None,
                truncated=(start + len(data) < total) if windowed else None,
            )

        return await self._file_op(sb, read, "Read file")

    async def read_bytes(
        self, sandbox_id: str, file_path: str, max_bytes: int | None = None
    ) -> bytes:
        """Read a file's bytes (at most ``max_bytes``; all of it when ``None``).

        A local extension of the API (prime-sandboxes reads text only): the same path
        rules as every file method. ``SandboxFileNotFoundError`` when missing.
        """
        sb = await self._running(sandbox_id)
        anchor, parts = self._locate(sb, file_path)

        def read() -> bytes:
            try:
                with files.open_for_read(anchor, parts) as (fd, total):
                    size = total if max_bytes is None else min(total, max_bytes)
                    return files.read_window(fd, 0, size)
            except (FileNotFoundError, NotADirectoryError):
                raise SandboxFileNotFoundError(f"File not found: {file_path}") from None

        data: bytes = await self._file_op(sb, read, "Read file")
        return data


__all__ = ["SandboxFileAPI"]
