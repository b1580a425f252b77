"""End an ``await`` early when a future resolves, without a helper task.

``asyncio.wait`` over a sleep and a signal costs a task, a context copy, sets and
callbacks per wait; with hundreds of rollouts waiting at once that is most of what the
env allocates while it waits (and what its garbage collector then walks). An
:class:`Interrupt` does what :func:`asyncio.timeout` does for a deadline, for a future:
when the future resolves, the waiting task is cancelled, and the cancellation is turned
back into a normal exit of the ``async with`` block (``fired`` tells why it ended).
A cancellation from outside still propagates.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any


class Interrupt:
    """``async with Interrupt(future) as it: await ...`` ends the block when ``future`` resolves.

    After the block, ``it.fired`` says whether the future ended it. A future already
    resolved on entry ends the block at its first suspension. ``future=None`` never
    fires (the block runs as if unguarded).
    """

    def __init__(self, future: asyncio.Future[Any] | None) -> None:
        self._future = future
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._armed = False
        #: Whether the future ended the block.
        self.fired = False

    async def __aenter__(self) -> Interrupt:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Interrupt must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        if self._future is not None:
            self._armed = True
            self._future.add_done_callback(self._on_done)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._armed = False  # a callback already scheduled must not cancel anything now
        if self._future is not None:
            self._future.remove_done_callback(self._on_done)
        if not self.fired:
            return False
        assert self._task is not None
        # Ours was the cancellation if no other one is pending (as asyncio.timeout decides).
        return self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError

    def _on_done(self, _future: asyncio.Future[Any]) -> None:
        if self._armed and self._task is not None and not self._task.done():
            self._armed = False
            self.fired = True
            self._task.cancel()


__all__ = ["Interrupt"]
