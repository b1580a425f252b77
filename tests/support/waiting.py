"""Waiting until something holds: :func:`eventually`."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` (a predicate, or a coroutine function) holds: what another
    gateway, connection or task does takes a moment."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, "did not hold in time"
        await asyncio.sleep(0.01)


__all__ = ["eventually"]
