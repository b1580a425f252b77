"""Blocking work off the event loop, so that a signal stops the demo promptly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking ``fn(*args)`` in a daemon thread; the caller can be cancelled at once.

    Used for imports and probes that take seconds, so that a signal stops the demo
    promptly: the event loop stays free to run its handler, and a cancelled caller does
    not wait for the thread (a daemon thread does not hold up the process's exit either,
    unlike ``asyncio.to_thread``'s pool).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return  # the caller gave up (cancelled)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the caller
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
                loop.call_soon_threadsafe(settle, None, e)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, None)

    name = f"{_THREAD_PREFIX}{getattr(fn, '__name__', 'work')}"
    threading.Thread(target=work, name=name, daemon=True).start()
    return await future


_THREAD_PREFIX = "demo-off-loop-"


def off_loop_threads() -> set[threading.Thread]:
    """The threads of :func:`off_loop` work still running."""
    return {t for t in threading.enumerate() if t.name.startswith(_THREAD_PREFIX)}


def exit_if_work_abandoned(code: int, before: set[threading.Thread]) -> None:
    """End the process now, with ``code``, when :func:`off_loop` work started by the run
    (not among ``before``) still runs.

    A stop during setup abandons the stack's import in its daemon thread; the
    interpreter's shutdown would then wait seconds for that import to let go of the GIL.
    Nothing of the run is left to clean up by then (the stack had not started: its
    sandboxes and servers come after the import), so output is flushed, logging shut down
    and the process ends. Only the command line calls this, after the run returned.
    """
    if not off_loop_threads() - before:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


__all__ = ["exit_if_work_abandoned", "off_loop", "off_loop_threads"]
