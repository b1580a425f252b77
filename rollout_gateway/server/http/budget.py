"""A budget of bytes shared by many holders, with a cap per key, waited for in order.

:class:`ByteBudget` is what request bodies are admitted against
(:mod:`.intake`): a request waits until its bytes fit both under the budget's capacity
(everyone's together) and under its key's cap (one rollout's requests together). Waiters
are served first come, first served on the shared capacity: a big request at the head
of the queue is not overtaken forever by small ones. A waiter whose own key is full is
passed over (its key's release wakes it), so one rollout waiting on itself never holds
up the others.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Waiter:
    key: Hashable
    nbytes: int
    future: asyncio.Future[None] = field(repr=False)


class ByteBudget:
    """Bytes held at once: at most ``capacity`` in all (``None``: no shared bound) and at
    most ``per_key`` under one key.

    Args:
        capacity: bytes all holders together may hold (``None``: unbounded).
        per_key: bytes the holders of one key together may hold.

    An amount over ``per_key`` or ``capacity`` could never be granted: :meth:`acquire`
    refuses it with ``ValueError`` instead of waiting forever.
    """

    def __init__(self, capacity: int | None, per_key: int) -> None:
        if per_key < 1 or (capacity is not None and capacity < 1):
            raise ValueError(f"capacity and per_key must be positive: {capacity!r}, {per_key!r}")
        self.capacity = capacity
        self.per_key = per_key
        #: Bytes held, in all.
        self.held = 0
        self._by_key: dict[Hashable, int] = {}
        self._waiters: deque[_Waiter] = deque()

    def held_by(self, key: Hashable) -> int:
        """Bytes the holders of ``key`` hold."""
        return self._by_key.get(key, 0)

    @property
    def waiting(self) -> int:
        """Acquisitions waiting."""
        return sum(1 for w in self._waiters if not w.future.done())

    def _fits(self, key: Hashable, nbytes: int) -> bool:
        return self._by_key.get(key, 0) + nbytes <= self.per_key

    def _take(self, key: Hashable, nbytes: int) -> None:
        self.held += nbytes
        self._by_key[key] = self._by_key.get(key, 0) + nbytes

    def try_acquire(self, key: Hashable, nbytes: int) -> bool:
        """Hold ``nbytes`` more under ``key`` if they fit now and nobody waits (the
        usual case: no coroutine, no future); whether it did."""
        held_by_key = self._by_key.get(key, 0) + nbytes
        if self._waiters or held_by_key > self.per_key:
            return False
        if self.capacity is not None and self.held + nbytes > self.capacity:
            return False
        self.held += nbytes
        self._by_key[key] = held_by_key
        return True

    async def acquire(self, key: Hashable, nbytes: int) -> None:
        """Hold ``nbytes`` more under ``key``, once they fit (see the class docstring)."""
        if nbytes <= 0 or self.try_acquire(key, nbytes):
            return
        if nbytes > self.per_key or (self.capacity is not None and nbytes > self.capacity):
            raise ValueError(f"{nbytes} bytes can never fit this budget")
        waiter = _Waiter(key, nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._grant()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(key, nbytes)  # granted as we were cancelled: give it back
            else:
                waiter.future.cancel()
                self._grant()  # it may have held up the queue
            raise

    def release(self, key: Hashable, nbytes: int) -> None:
        """Give back ``nbytes`` held under ``key``."""
        if nbytes <= 0:
            return
        by_key = self._by_key
        left = by_key.get(key, 0) - nbytes
        if left < 0:
            raise RuntimeError(f"released more than {key!r} holds")
        if left:
            by_key[key] = left
        else:
            del by_key[key]
        self.held -= nbytes
        if self._waiters:
            self._grant()

    def _grant(self) -> None:
        """Wake the waiters that fit now, in order (see the module docstring)."""
        if not self._waiters:
            return
        for waiter in list(self._waiters):
            if waiter.future.done():  # cancelled
                self._waiters.remove(waiter)
                continue
            if not self._fits(waiter.key, waiter.nbytes):
                continue  # its own key is full: its key's release wakes it
            if self.capacity is not None and self.held + waiter.nbytes > self.capacity:
                break  # first come, first served on the shared capacity
            self._waiters.remove(waiter)
            self._take(waiter.key, waiter.nbytes)
            waiter.future.set_result(None)


__all__ = ["ByteBudget"]
