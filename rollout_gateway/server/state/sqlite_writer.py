"""The SQLite backend's writer: one thread, group commit.

Writes are functions of a connection, submitted from the event loop
(:meth:`GroupCommitWriter.submit` returns a future). The thread runs every write waiting
when it wakes in one transaction (each in a savepoint, so a write that raises leaves no
trace and the others still commit), commits once, then resolves their futures with one
wake-up of the loop. A turn waits for the commit that holds it; while one commit is on
its way to the disk, the writes of the next gather: at many turns in flight a commit
holds many turns, and the cost of a commit (and of its flush to the device, in
``synchronous=FULL``) is shared by them.

A failed commit (disk full, I/O error) fails every write of its transaction with
:class:`~.store.StoreUnavailableError`; nothing of it is on disk.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

from rollout_gateway.server.state.store import StoreError, StoreUnavailableError

logger = logging.getLogger("rollout_gateway.server")

#: A write: a function of the writer's connection (its result resolves the future).
Write = Callable[[sqlite3.Connection], Any]

_STOP = object()


class GroupCommitWriter:
    """The thread that writes to one SQLite database.

    Args:
        connect: opens the writer's connection (called in the thread).
        name: the thread's name.
    """

    def __init__(self, connect: Callable[[], sqlite3.Connection], *, name: str) -> None:
        self._connect = connect
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        #: Transactions committed, and writes they held (the group commit's effect).
        self.commits = 0
        self.writes = 0

    def start(self) -> None:
        """Start the thread and open its connection (raises what opening raised)."""
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def submit(self, write: Write) -> asyncio.Future[Any]:
        """Queue ``write`` for the next transaction; its future resolves once that
        transaction is committed (with ``write``'s result or error)."""
        if self._closed:
            raise StoreUnavailableError("the state store is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((write, future, loop))
        return future

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit what is queued, then stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            conn = self._connect()
        except BaseException as exc:
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                while True:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if any(item is _STOP for item in batch):
                    stop = True
                    batch = [item for item in batch if item is not _STOP]
                if batch:
                    self._commit(conn, batch)
        finally:
            conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list[Any]) -> None:
        results: list[Any] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for write, _, _ in batch:
                    results.append(self._one(conn, write))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            logger.error("state store: a commit of %d writes failed: %s", len(batch), exc)
            failure = StoreUnavailableError(f"the state database could not be written: {exc}")
            results = [failure] * len(batch)
        self.commits += 1
        self.writes += len(batch)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for (_, future, loop), result in zip(batch, results, strict=True):
            by_loop.setdefault(loop, []).append((future, result))
        for loop, done in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, done)
            except RuntimeError:  # the loop closed: nobody waits
                pass

    @staticmethod
    def _one(conn: sqlite3.Connection, write: Write) -> Any:
        conn.execute("SAVEPOINT w")
        try:
            result = write(conn)
        except (StoreError, sqlite3.IntegrityError) as exc:
            conn.execute("ROLLBACK TO w")
            conn.execute("RELEASE w")
            return exc if isinstance(exc, StoreError) else StoreError(str(exc))
        conn.execute("RELEASE w")
        return result


def _resolve(done: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, result in done:
        if future.cancelled():
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


__all__ = ["GroupCommitWriter", "Write"]
