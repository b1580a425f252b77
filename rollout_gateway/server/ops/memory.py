"""Give memory back to the OS after rollouts go away, and after big request bodies.

A rollout's trajectory is many small objects (messages, dicts, strings) spread over the
allocator's arenas; when a burst of rollouts is unregistered, the process keeps the
freed pages (glibc keeps its heap, top-padded) and RSS stays at its peak. A big request
body is the same in one request: its bytes and the objects parsed from it are freed
when it is answered, but glibc keeps what its heap grew by (a freed 16 MiB buffer raises
glibc's mmap threshold, so the next ones come from the heap and stay). After enough
rollouts were removed, or enough big bodies' memory was freed, :class:`MemoryTrimmer`
runs ``malloc_trim(0)`` in a worker thread (it can take milliseconds on a big heap; the
event loop keeps serving meanwhile). Linux/glibc only; a no-op elsewhere.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger("rollout_gateway.server")


def _glibc_malloc_trim() -> Callable[[], object] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


#: Bytes of big request bodies freed (at their estimated cost) that make a trim due.
FREED_BYTES_PER_TRIM = 64 * 1024 * 1024


class MemoryTrimmer:
    """Trim the heap once ``every`` rollouts were removed, or ``every_bytes`` of big
    request bodies were freed, since the last trim."""

    def __init__(
        self,
        every: int = 64,
        trim: Callable[[], object] | None = None,
        every_bytes: int = FREED_BYTES_PER_TRIM,
    ) -> None:
        self.every = every
        self.every_bytes = every_bytes
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._removed = 0
        self._freed = 0
        self._running = False
        self.trims = 0

    def removed(self) -> None:
        """One rollout went away (call from the event loop)."""
        self._removed += 1
        self._maybe_trim()

    def freed(self, nbytes: int) -> None:
        """A big request body's memory (``nbytes``, estimated) was freed (call from the
        event loop)."""
        self._freed += nbytes
        self._maybe_trim()

    def _maybe_trim(self) -> None:
        if self._trim is None or self._running:
            return
        if self._removed < self.every and self._freed < self.every_bytes:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._removed = self._freed = 0
        self._running = True
        loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            assert self._trim is not None
            await asyncio.to_thread(self._trim)
            self.trims += 1
        except Exception:  # never let housekeeping hurt serving
            logger.exception("malloc_trim failed")
        finally:
            self._running = False


__all__ = ["FREED_BYTES_PER_TRIM", "MemoryTrimmer"]
