"""The SQLite backend's database: connections, tables, and which versions it reads.

A database is recognised by its ``application_id`` (:data:`APPLICATION_ID`) and its
schema by ``user_version`` (:data:`SCHEMA_VERSION`): a database of another schema is
refused with a message (:class:`~.store.StoreVersionError`), never read as this one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import sqlite3
import time
from pathlib import Path

from rollout_gateway.server.state.store import (
    StoreCorruptError,
    StoreUnavailableError,
    StoreVersionError,
)

# Every record is bound as ``bytes``, a type ``sqlite3`` adapts (only int, float, str and
# bytearray go straight to SQLite): with no adapter registered it looks for ``__adapt__``
# on its protocol type, which raises an AttributeError, formatted and cleared, for each
# such parameter (some 1.5 k instructions each, four a turn). An adapter that returns the
# bytes themselves (``bytes(b) is b``) is found first: the same value bound, no error.
sqlite3.register_adapter(bytes, bytes)

#: The database file in the state directory.
DATABASE_FILE = "state.db"
#: The file a gateway locks to hold the directory.
LOCK_FILE = "lock"
#: ``PRAGMA application_id`` of a rollout-gateway state database ("RGst").
APPLICATION_ID = 0x52477374
#: ``PRAGMA user_version``: the schema this gateway writes and reads (2: the records of
#: :data:`~.codec.FORMAT_VERSION` 2).
SCHEMA_VERSION = 2
#: Page cache of a connection, KiB.
CACHE_KIB = 16 * 1024
#: Page size of a new database: steps of a few kB pack densely (at 4 KiB, one to a page).
PAGE_SIZE = 16384

#: Steps are appended in commit order (an append to the table's last page, the cheapest
#: write a B-tree has) and found by the (rollout, idx) index; a step row carries the
#: rollout's counters and revision after its turn, so a turn is one insert (and the
#: answer's update) and the rollout's row is only written when something else changes.
_TABLES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE rollouts (
    id INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL UNIQUE,
    key_digest TEXT,
    registration BLOB NOT NULL,
    counters BLOB NOT NULL,
    revision INTEGER NOT NULL,
    cancelled INTEGER NOT NULL
);
CREATE INDEX rollouts_by_key ON rollouts (key_digest);
CREATE TABLE steps (
    id INTEGER PRIMARY KEY,
    rollout INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    revision INTEGER NOT NULL,
    counters BLOB NOT NULL,
    body BLOB NOT NULL
);
CREATE UNIQUE INDEX steps_by_rollout ON steps (rollout, idx);
CREATE TABLE answers (rollout INTEGER PRIMARY KEY, answer_key BLOB, answer BLOB);
CREATE TABLE exits (rollout_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, report BLOB NOT NULL);
"""

#: A turn's write as one statement: a step inserted and, when it has one, the rollout's
#: answer replaced, by inserting a row into this view (of the writer's connection only:
#: ``TEMP``, so not part of the database's schema). One statement, not two, goes through
#: ``sqlite3`` a turn, and a turn committed alone needs no ``BEGIN`` and ``COMMIT`` around
#: it (a statement is atomic: it fails whole).
_TURN_VIEW = """
CREATE TEMP VIEW turns AS
    SELECT rollout, idx, revision, counters, body, NULL AS answer_key, NULL AS answer
    FROM main.steps;
CREATE TEMP TRIGGER turns_insert INSTEAD OF INSERT ON turns BEGIN
    INSERT INTO steps (rollout, idx, revision, counters, body)
        VALUES (NEW.rollout, NEW.idx, NEW.revision, NEW.counters, NEW.body);
    UPDATE answers SET answer_key = NEW.answer_key, answer = NEW.answer
        WHERE NEW.answer IS NOT NULL AND rollout = NEW.rollout;
END;
"""

#: Inserts a turn (:data:`_TURN_VIEW`): rollout, idx, revision, counters, body, answer key
#: and answer (``NULL`` both: the answer is left as it is).
INSERT_TURN = "INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?)"

_META_DEFAULTS = (
    ("exit_cursor", 0),
    ("policy_version", None),
    ("policy_updated_at", None),
)


#: Free space the state directory must have at start (a full disk is refused then,
#: not found at the first turn).
MIN_FREE_BYTES = 16 * 1024 * 1024


def lock_directory(directory: Path, database: Path) -> int:
    """Make ``directory`` (0700) and the database file (0600: it holds trajectories and
    keys' digests), and lock the directory for this process; the lock's file descriptor
    (closing it releases the lock, as the process's end does).

    Raises :class:`~.store.StoreUnavailableError` when the directory cannot be made,
    another gateway holds it, or its disk is full.
    """
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StoreUnavailableError(f"state directory {directory}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StoreUnavailableError(
            f"state directory {directory} is in use by another gateway "
            "(one gateway per state directory)"
        ) from None
    try:
        with contextlib.suppress(FileExistsError):
            os.close(os.open(database, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        stats = os.statvfs(directory)
        free = stats.f_bavail * stats.f_frsize
    except OSError as exc:
        os.close(fd)
        raise StoreUnavailableError(f"state directory {directory}: {exc.strerror or exc}") from None
    if free < MIN_FREE_BYTES:
        os.close(fd)
        raise StoreUnavailableError(
            f"state directory {directory}: the disk is full ({free} bytes free, at least "
            f"{MIN_FREE_BYTES} needed)"
        )
    return fd


def connect(path: Path, synchronous: str) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode (autocommit: transactions are explicit).

    Raises :class:`~.store.StoreUnavailableError` when the file cannot be opened or
    written.
    """
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
    except sqlite3.Error as exc:
        raise _unavailable(path, exc) from None
    try:
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # a new database's (before WAL)
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StoreUnavailableError(f"{path}: the database cannot use a write-ahead log")
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        # The pages a turn's write descends through (the tables' right edges, the index,
        # the answers of the rollouts in flight) stay cached as the database grows.
        conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    except sqlite3.DatabaseError as exc:
        conn.close()
        if "not a database" in str(exc) or "malformed" in str(exc):
            raise StoreCorruptError(f"{path}: {exc}") from None
        raise _unavailable(path, exc) from None
    return conn


def connect_writer(path: Path, synchronous: str) -> sqlite3.Connection:
    """:func:`connect`, with the view a turn is written through (:data:`INSERT_TURN`)."""
    conn = connect(path, synchronous)
    try:
        conn.execute("PRAGMA temp_store = MEMORY")  # the view's schema: no temporary file
        conn.executescript(_TURN_VIEW)  # (autocommit: nothing pending to commit)
    except sqlite3.Error as exc:
        conn.close()
        raise _unavailable(path, exc) from None
    return conn


def _unavailable(path: Path, exc: sqlite3.Error) -> StoreUnavailableError:
    hint = ""
    text = str(exc)
    if "disk I/O" in text or "full" in text:
        hint = " (is the disk full?)"
    elif "readonly" in text or "unable to open" in text:
        hint = " (is the directory writable?)"
    return StoreUnavailableError(f"{path}: {text}{hint}")


def prepare(conn: sqlite3.Connection, secret: bytes | None = None) -> bytes:
    """Create the tables of a new database, or check an existing one's schema; return
    its secret. A write (the open time) proves the database writable now.

    Raises :class:`~.store.StoreVersionError` for another schema or a file that is not
    a rollout-gateway state database, :class:`~.store.StoreUnavailableError` when it
    cannot be written.
    """
    path = Path(conn.execute("PRAGMA database_list").fetchone()[2] or "?")
    try:
        application_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0]
        conn.execute("BEGIN IMMEDIATE")
        try:
            if tables == 0 and application_id == 0:
                for statement in _TABLES.split(";"):  # (executescript would commit)
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('secret', ?)",
                    (secret or secrets.token_bytes(32),),
                )
                conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", _META_DEFAULTS)
            elif application_id != APPLICATION_ID:
                raise StoreVersionError(
                    f"{path} is not a rollout-gateway state database (application id "
                    f"{application_id:#x}): refusing to use it; point --state-dir elsewhere"
                )
            elif version != SCHEMA_VERSION:
                raise StoreVersionError(
                    f"{path} holds state of schema version {version}, written by another "
                    f"version of rollout-gateway; this one reads version {SCHEMA_VERSION}. "
                    "Run the version that wrote it, or move the directory aside"
                )
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('opened_at', ?)", (time.time(),)
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        found = conn.execute("SELECT value FROM meta WHERE key = 'secret'").fetchone()
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError) and "malformed" not in str(exc):
            raise _unavailable(path, exc) from None
        raise StoreCorruptError(f"{path}: {exc}") from None
    if found is None or not isinstance(found[0], bytes) or len(found[0]) != 32:
        raise StoreCorruptError(f"{path}: the store's secret is missing or damaged")
    return bytes(found[0])


__all__ = [
    "APPLICATION_ID",
    "DATABASE_FILE",
    "INSERT_TURN",
    "LOCK_FILE",
    "MIN_FREE_BYTES",
    "SCHEMA_VERSION",
    "connect",
    "connect_writer",
    "lock_directory",
    "prepare",
]
