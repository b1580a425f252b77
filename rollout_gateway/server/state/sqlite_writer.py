"""The SQLite backend's writers: group commit on the event loop, or on a thread.

Writes are functions of a connection, submitted from the event loop (``submit`` returns a
future). The writes waiting together run in one transaction, committed once; their
futures resolve when it is committed (a turn waits for the commit that holds it). A write
must fail before it changes anything (checks first): no savepoints are taken.

* :class:`LoopWriter` (``synchronous=NORMAL``): the writes submitted during one pass of
  the event loop are committed at the end of that pass, on the loop's thread. A commit
  is then a few ``write()`` calls into the database's log, no flush to the device; this
  was the cheapest in CPU per turn (a thread's hand-offs of the interpreter lock cost
  more than the commits they would take off the loop). The log is folded into the
  database (a checkpoint, with its flushes to the device) by a thread of its own
  (:class:`Checkpointer`), never on the loop.
* :class:`ThreadWriter` (``synchronous=FULL``): each commit is flushed to the device
  (milliseconds): one thread commits, and while it does the next writes gather, so one
  flush serves every turn that arrived meanwhile.

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
from pathlib import Path
from typing import Any, NamedTuple

from rollout_gateway.server.state.pass_batch import PassBatch
from rollout_gateway.server.state.sqlite_schema import connect_writer
from rollout_gateway.server.state.store import StoreError, StoreUnavailableError

logger = logging.getLogger("rollout_gateway.server")


class Statement(NamedTuple):
    """A write that is one statement (its result: ``None``)."""

    sql: str
    params: tuple[Any, ...]


#: A write: a function of the writer's connection (its result resolves the future), or
#: one :class:`Statement`.
Write = Callable[[sqlite3.Connection], Any] | Statement
#: Opens a connection to the database.
Connect = Callable[[], sqlite3.Connection]

_STOP = object()

#: The log is folded into the database once it holds this many bytes.
CHECKPOINT_BYTES = 8 * 1024 * 1024


def commit(
    conn: sqlite3.Connection, writes: list[Write], cursor: sqlite3.Cursor | None = None
) -> list[Any]:
    """Run ``writes`` in one transaction; each one's result, or the error it raised (a
    :class:`~.store.StoreError`). A failed commit fails them all. ``cursor`` (of ``conn``)
    runs the ``BEGIN``, the ``COMMIT`` and the statements (a writer's own:
    ``conn.execute`` makes a cursor each time). A lone :class:`Statement` runs as its own
    transaction (SQLite commits a statement run outside one when it ends, or undoes the
    whole of it when it fails): no ``BEGIN`` and ``COMMIT``."""
    statements = conn.cursor() if cursor is None else cursor
    try:
        if len(writes) == 1 and isinstance(writes[0], Statement):
            statements.execute(*writes[0])
            return [None]
        return _transaction(conn, statements, writes)
    except sqlite3.Error as exc:
        logger.error("state store: a commit of %d writes failed: %s", len(writes), exc)
        failure = StoreUnavailableError(f"the state database could not be written: {exc}")
        return [failure] * len(writes)


def _transaction(
    conn: sqlite3.Connection, statements: sqlite3.Cursor, writes: list[Write]
) -> list[Any]:
    results: list[Any] = []
    statements.execute("BEGIN IMMEDIATE")
    try:
        for write in writes:
            if isinstance(write, Statement):
                statements.execute(*write)
                results.append(None)
                continue
            try:
                results.append(write(conn))
            except StoreError as exc:  # refused before it changed anything
                results.append(exc)
        statements.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return results


def _resolve(done: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, result in done:
        _resolve_one(future, result)


def _resolve_one(future: asyncio.Future[Any], result: Any) -> None:
    if future.cancelled():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class LoopWriter:
    """Commits on the event loop, once per pass of the loop (see the module doc).

    Args:
        connect: opens the writer's connection.
        wal: the database's log file (the checkpointer watches its size).
    """

    def __init__(self, connect: Connect, wal: Path) -> None:
        self._connect = connect
        self._conn: sqlite3.Connection | None = None
        self._cursor: sqlite3.Cursor | None = None
        self._batch: PassBatch[tuple[Write, asyncio.Future[Any]]] = PassBatch(self._commit)
        self._checkpointer = Checkpointer(connect, wal)
        #: Transactions committed, and writes they held (the group commit's effect).
        self.commits = 0
        self.writes = 0

    def start(self) -> None:
        """Open the connection and start the checkpointer (raises what opening raised)."""
        conn = self._connect()
        conn.execute("PRAGMA wal_autocheckpoint = 0")  # the checkpointer's job, off the loop
        self._conn, self._cursor = conn, conn.cursor()
        self._checkpointer.start()

    def submit(self, write: Write) -> asyncio.Future[Any]:
        """Queue ``write`` for this pass's transaction."""
        if self._conn is None:
            raise StoreUnavailableError("the state store is closed")
        future = asyncio.get_running_loop().create_future()
        self._batch.add((write, future))
        return future

    def _commit(self, batch: list[tuple[Write, asyncio.Future[Any]]]) -> None:
        if self._conn is None:
            return
        if len(batch) == 1:  # a quiet gateway's lone turn: no lists built around it
            write, future = batch[0]
            (result,) = commit(self._conn, [write], self._cursor)
            self.commits += 1
            self.writes += 1
            _resolve_one(future, result)
        else:
            results = commit(self._conn, [write for write, _ in batch], self._cursor)
            self.commits += 1
            self.writes += len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                _resolve_one(future, result)
        self._checkpointer.committed()

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit what is queued, stop the checkpointer, close. Idempotent."""
        if self._conn is None:
            return
        self._batch.flush_now()
        self._checkpointer.close(timeout_s)
        if self._cursor is not None:
            self._cursor.close()
        self._conn.close()
        self._conn, self._cursor = None, None


class Checkpointer:
    """A thread that folds the log into the database when it has grown
    (``PRAGMA wal_checkpoint(PASSIVE)``: it never blocks the writer), looking at the
    log's size every 64th commit."""

    def __init__(self, connect: Connect, wal: Path, *, every_bytes: int = CHECKPOINT_BYTES) -> None:
        self._connect = connect
        self._wal = wal
        self._every_bytes = every_bytes
        self._wake = threading.Event()
        self._stop = False
        self._commits = 0
        self._thread = threading.Thread(
            target=self._run, name="rollout-gateway-checkpoint", daemon=True
        )

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def committed(self) -> None:
        """A commit happened (every 64th wakes the thread to look at the log's size)."""
        self._commits += 1
        if self._commits % 64 == 0:
            self._wake.set()

    def close(self, timeout_s: float) -> None:
        """Stop the thread."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            conn = self._connect()
        except StoreError as exc:
            logger.error("state store: the checkpointer cannot open the database: %s", exc)
            return
        try:
            while not self._stop:
                # Woken by commits (every 64th) and close only: a timer waking it every
                # second cost the loop's thread the interpreter lock's hand-offs on an idle
                # gateway too, and a log only grows by commits. (A log past the threshold
                # when commits stop is folded at the 64th commit after, or at close.)
                self._wake.wait()
                self._wake.clear()
                try:
                    if self._wal.stat().st_size >= self._every_bytes:
                        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except (OSError, sqlite3.Error) as exc:
                    logger.warning("state store: checkpoint failed: %s", exc)
        finally:
            conn.close()


class ThreadWriter:
    """Commits on a thread of its own, with group commit (see the module doc).

    Args:
        connect: opens the writer's connection (called in the thread).
    """

    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-gateway-state", daemon=True)
        self._closed = False
        self.commits = 0
        self.writes = 0

    def start(self) -> None:
        """Start the thread and open its connection (raises what opening raised)."""
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def submit(self, write: Write) -> asyncio.Future[Any]:
        """Queue ``write`` for the next transaction."""
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
        results = commit(conn, [write for write, _, _ in batch])
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


#: Either writer.
Writer = LoopWriter | ThreadWriter


def open_writer(path: Path, synchronous: str) -> Writer:
    """The writer ``synchronous`` asks for on the database at ``path``, started: on the
    loop (``"normal"``) or on a thread (``"full"``)."""

    def connection() -> sqlite3.Connection:
        return connect_writer(path, synchronous)

    if synchronous == "full":
        writer: Writer = ThreadWriter(connection)
    else:
        writer = LoopWriter(connection, Path(f"{path}-wal"))
    writer.start()
    return writer


async def close_writer(writer: Writer) -> None:
    """Commit what is queued and stop (a thread writer's last commit off the loop)."""
    if isinstance(writer, ThreadWriter):
        await asyncio.get_running_loop().run_in_executor(None, writer.close)
    else:
        writer.close()  # its last commit runs here, on the loop


__all__ = [
    "CHECKPOINT_BYTES",
    "Checkpointer",
    "LoopWriter",
    "Statement",
    "ThreadWriter",
    "Write",
    "Writer",
    "close_writer",
    "commit",
    "open_writer",
]
