"""Work submitted during one pass of the event loop, done together at its end: :class:`PassBatch`.

The SQLite backend commits the writes of one pass in one transaction
(:class:`~.sqlite_writer.LoopWriter`) and the Redis backend sends the commands of one pass
in one pipeline (:class:`~.redis_backend.batches.CommandBatches`): concurrent turns share
the cost of a commit or a round trip, and a quiet gateway's lone item goes alone, one loop
iteration later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PassBatch(Generic[T]):
    """Items added during one pass of the running event loop, handed together to
    ``flush`` at the end of the pass (in the order they were added).

    Args:
        flush: does the work of a batch (on the loop; it must not block for long).
    """

    __slots__ = ("_flush", "_pending", "_scheduled")

    def __init__(self, flush: Callable[[list[T]], None]) -> None:
        self._flush = flush
        self._pending: list[T] = []
        self._scheduled = False

    def add(self, item: T) -> None:
        """Add ``item`` to this pass's batch."""
        self._pending.append(item)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush_now)

    def flush_now(self) -> None:
        """Hand what is pending to ``flush`` now (the end of the pass, or a close)."""
        self._scheduled = False
        batch, self._pending = self._pending, []
        if batch:
            self._flush(batch)


__all__ = ["PassBatch"]
