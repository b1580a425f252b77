"""The SQLite backend: one gateway's state, durable across restarts (``serve --state-dir``).

One database file (``state.db``) in WAL mode, in a directory one gateway holds (a lock
file: a second gateway on the same directory is refused). Writes go through one
writer with group commit (:mod:`.sqlite_writer`: on the event loop, or with
``synchronous="full"`` on a thread); a turn's write is committed before the agent gets
its answer. Reads (a rollout reloaded, its steps replayed at first use after a
restart) use a connection of their own on the event loop's thread.

Tables (:mod:`.sqlite_schema`): ``meta`` (secret, exit cursor, policy version),
``rollouts`` (a row per rollout: sealed registration and counters, revision, cancelled
flag), ``steps`` (a row per step in commit order: its :func:`~.codec.encode_step` bytes
and the rollout's counters and revision after it), ``answers`` (each rollout's last
answer) and ``exits``. Every record is checksummed
(:mod:`.codec`). At open the database's structure is checked (``PRAGMA quick_check``) and
every rollout and step read and checked; damage is reported with what was kept (see
:mod:`.sqlite_recovery`), never served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import StepDelta
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.sqlite_reads import read_answer, read_steps
from rollout_gateway.server.state.sqlite_recovery import load_row, open_checked
from rollout_gateway.server.state.sqlite_schema import (
    DATABASE_FILE,
    INSERT_TURN,
    connect,
    lock_directory,
)
from rollout_gateway.server.state.sqlite_writer import (
    Statement,
    Writer,
    close_writer,
    open_writer,
)
from rollout_gateway.server.state.store import (
    PolicyState,
    RolloutCounters,
    RolloutExistsError,
    RolloutRow,
    RolloutStore,
    StoreContents,
    StoredAnswer,
    StoreUnavailableError,
    TurnCommit,
    TurnConflictError,
    UnknownRolloutError,
)

logger = logging.getLogger("rollout_gateway.server")

#: The health check writes a row only when no write succeeded for this long (a commit is
#: a few 16 KiB pages of log: one a second would be ~50 KiB/s of writes on an idle gateway).
CHECK_IDLE_S = 10.0


@dataclass(slots=True)
class _Held:
    """What the store keeps in memory of a stored rollout (single writer: always current)."""

    row_id: int
    revision: int
    steps: int


class SQLiteStore(RolloutStore):
    """A gateway's state in ``directory/state.db``.

    Args:
        directory: the state directory (created 0700 when missing).
        synchronous: ``"normal"`` (a commit is in the database's log: it survives the
            process; the log is flushed to the device at checkpoints) or ``"full"`` (each
            commit is flushed to the device: it survives power loss).
    """

    name = "sqlite"
    durable = True

    def __init__(self, directory: str | os.PathLike[str], *, synchronous: str = "normal") -> None:
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous: 'normal' or 'full', not {synchronous!r}")
        self.directory = Path(directory)
        self.path = self.directory / DATABASE_FILE
        self.synchronous = synchronous
        self._secret = b""
        self._lock_fd: int | None = None
        self._reader: sqlite3.Connection | None = None
        self._writer: Writer | None = None
        self._held: dict[str, _Held] = {}
        self._contents: StoreContents | None = None
        #: Monotonic time of the last write that succeeded (``None``: none, or one failed since).
        self._written_at: float | None = None

    @property
    def secret(self) -> bytes:
        """Made when the database was created; read from it at every open."""
        return self._secret

    # -- open and close ------------------------------------------------------------------

    async def open(self) -> StoreContents:
        """Open the directory's database (see the module doc). Idempotent: a second call
        returns what the first found."""
        if self._contents is None:
            self._contents = self._open()
        return self._contents

    def _open(self) -> StoreContents:
        self._lock_fd = lock_directory(self.directory, self.path)
        try:
            self._secret, loaded, damage = open_checked(self.path, self.synchronous)
            self._reader = connect(self.path, self.synchronous)
            self._writer = open_writer(self.path, self.synchronous)
        except BaseException:
            self._release()
            raise
        self._held = {
            row.registration["rollout_id"]: _Held(row_id, row.revision, row.steps)
            for row_id, row in loaded.rollouts
        }
        return loaded.contents(damage)

    async def close(self) -> None:
        """Commit what is queued, checkpoint the log into the database, release it."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await close_writer(writer)
        if self._reader is not None:
            with contextlib.suppress(sqlite3.Error):
                self._reader.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._release()

    def _release(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    # -- plumbing ------------------------------------------------------------------------

    async def _write(self, write: Any, rollout_id: str | None = None) -> Any:
        """Run ``write`` in the writer's next transaction; its result. When it fails and
        ``rollout_id`` is given, the rollout's held figures are read back from the
        database (what the failed write counted on was not written). The writer's future
        is awaited here, with no coroutine between (a turn's write comes through here)."""
        writer = self._writer
        try:
            if writer is None:
                raise StoreUnavailableError("the state store is not open")
            result = await writer.submit(write)
        except BaseException as exc:
            if writer is not None and isinstance(exc, StoreUnavailableError):
                self._written_at = None  # the health check writes until a write succeeds
            if rollout_id is not None:
                self._read_back(rollout_id)
            raise
        self._written_at = time.monotonic()
        return result

    def _read(self) -> sqlite3.Connection:
        if self._reader is None:
            raise StoreUnavailableError("the state store is not open")
        return self._reader

    def _get(self, rollout_id: str) -> _Held:
        if self._writer is None:
            raise StoreUnavailableError("the state store is not open")
        held = self._held.get(rollout_id)
        if held is None:
            raise UnknownRolloutError(rollout_id)
        return held

    # -- rollouts ------------------------------------------------------------------------

    async def create_rollout(self, row: RolloutRow) -> None:
        """Insert the rollout's row (and its empty answer)."""
        rollout_id = row.registration["rollout_id"]
        if rollout_id in self._held:
            raise RolloutExistsError(rollout_id)
        registration = codec.encode_json(row.registration)
        counters = codec.encode_json(row.counters)
        digest = row.registration.get("key_digest")

        def write(conn: sqlite3.Connection) -> int:
            # Checked first: a write must fail before it changes anything (no savepoints).
            taken = "SELECT 1 FROM rollouts WHERE rollout_id = ?"
            if conn.execute(taken, (rollout_id,)).fetchone() is not None:
                raise RolloutExistsError(rollout_id)
            cursor = conn.execute(
                "INSERT INTO rollouts (rollout_id, key_digest, registration, counters, revision, "
                "cancelled) VALUES (?, ?, ?, ?, 0, 0)",
                (rollout_id, digest, registration, counters),
            )
            row_id = cursor.lastrowid
            assert row_id is not None
            conn.execute("INSERT INTO answers (rollout) VALUES (?)", (row_id,))
            return row_id

        row_id = await self._write(write)
        self._held[rollout_id] = _Held(row_id, 0, 0)

    async def load_rollout(self, rollout_id: str) -> RolloutRow | None:
        """Read the rollout's row back (with its last step's counters)."""
        return load_row(self._read(), rollout_id)

    async def rollout_for_key(self, key_digest: str) -> str | None:
        """The rollout whose key has this digest."""
        found = (
            self._read()
            .execute("SELECT rollout_id FROM rollouts WHERE key_digest = ?", (key_digest,))
            .fetchone()
        )
        return found[0] if found is not None else None

    async def save_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Replace the counters."""
        return await self._update(rollout_id, codec.encode_json(counters), cancel=False)

    async def cancel_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Cancel for good and replace the counters."""
        return await self._update(rollout_id, codec.encode_json(counters), cancel=True)

    async def _update(self, rollout_id: str, counters: bytes, *, cancel: bool) -> int:
        held = self._get(rollout_id)
        row_id, revision = held.row_id, held.revision + 1
        held.revision = revision  # the next write goes on from it (writes run in order)
        sql = "UPDATE rollouts SET counters = ?, revision = ?" + (
            ", cancelled = 1" if cancel else ""
        )

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(sql + " WHERE id = ?", (counters, revision, row_id))

        await self._write(write, rollout_id)
        return revision

    async def delete_rollout(self, rollout_id: str) -> bool:
        """Delete the rollout's row, steps, answer and exit report."""
        held = self._held.pop(rollout_id, None)

        def write(conn: sqlite3.Connection) -> bool:
            conn.execute("DELETE FROM exits WHERE rollout_id = ?", (rollout_id,))
            if held is None:
                return False
            conn.execute("DELETE FROM steps WHERE rollout = ?", (held.row_id,))
            conn.execute("DELETE FROM answers WHERE rollout = ?", (held.row_id,))
            conn.execute("DELETE FROM rollouts WHERE id = ?", (held.row_id,))
            return True

        try:
            return bool(await self._write(write))
        except BaseException:
            if held is not None:
                self._held.setdefault(rollout_id, held)  # still stored
            raise

    # -- turns ---------------------------------------------------------------------------

    async def commit_turn(self, rollout_id: str, commit: TurnCommit) -> int:
        """The step with the counters, and the answer, if the step is next."""
        held = self._get(rollout_id)
        if commit.index != held.steps:
            raise TurnConflictError(
                f"rollout {rollout_id}: step {commit.index} committed on {held.steps}"
            )
        row_id, index, revision = held.row_id, commit.index, held.revision + 1
        key = answer = None
        if commit.answer is not None:
            key = codec.encode_answer_key(commit.answer.key)
            answer = codec.encode_answer(commit.answer)
        turn = (
            row_id, index, revision, codec.encode_json(commit.counters),
            codec.encode_step(commit.step), key, answer,
        )  # fmt: skip
        held.revision, held.steps = revision, index + 1  # the next turn goes on from them
        await self._write(Statement(INSERT_TURN, turn), rollout_id)
        return revision

    def _read_back(self, rollout_id: str) -> None:
        """The rollout's held figures read back from the database (after a failed write)."""
        if rollout_id in self._held:
            found = load_row(self._read(), rollout_id)
            if found is None:
                self._held.pop(rollout_id, None)
            else:
                held = self._held[rollout_id]
                held.revision, held.steps = found.revision, found.steps

    async def load_steps(self, rollout_id: str, start: int = 0) -> list[StepDelta]:
        """Read the steps back, each checked."""
        held = self._get(rollout_id)
        return read_steps(self._read(), rollout_id, held.row_id, start, held.steps)

    async def load_answer(self, rollout_id: str) -> StoredAnswer | None:
        """The last answer (without the prompt's ids when it had them)."""
        held = self._held.get(rollout_id)
        return None if held is None else read_answer(self._read(), rollout_id, held.row_id)

    # -- exit reports and the policy version -----------------------------------------------

    async def save_exit(self, report: ExitReport) -> None:
        """Keep the report; the cursor goes on from its number."""
        rollout_id, seq = report["rollout_id"], report["seq"]
        blob = codec.encode_json(report)

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT OR REPLACE INTO exits (rollout_id, seq, report) VALUES (?, ?, ?)",
                (rollout_id, seq, blob),
            )
            conn.execute("UPDATE meta SET value = max(value, ?) WHERE key = 'exit_cursor'", (seq,))

        await self._write(write)

    async def forget_exit(self, rollout_id: str) -> None:
        """Drop the rollout's report."""
        await self._write(
            lambda conn: conn.execute("DELETE FROM exits WHERE rollout_id = ?", (rollout_id,))
        )

    async def announce_policy(self, version: int, at: float) -> PolicyState:
        """Forward only, decided in the writer's transaction."""
        state: PolicyState = await self._write(lambda conn: _announce(conn, version, at))
        return state

    async def load_policy(self) -> PolicyState:
        """The version in effect."""
        return _policy(self._read())

    async def check(self) -> None:
        """Whether the database can be written: a write succeeded in the last
        :data:`CHECK_IDLE_S` seconds (turns write all the time), else a write of one row
        (the time of the check), committed as turns are. A disk that is full or failing
        raises (and every check writes until a write succeeds again)."""
        written = self._written_at
        if written is not None and time.monotonic() - written < CHECK_IDLE_S:
            return
        await self._write(_note_check)


def _note_check(conn: sqlite3.Connection) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES ('checked_at', ?)", (time.time(),)
    )


def _announce(conn: sqlite3.Connection, version: int, at: float) -> PolicyState:
    current = _policy(conn)
    if current.version is None or version > current.version:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'policy_version'", (version,))
        conn.execute("UPDATE meta SET value = ? WHERE key = 'policy_updated_at'", (at,))
        return PolicyState(version, at)
    return current


def _policy(conn: sqlite3.Connection) -> PolicyState:
    values = dict(
        conn.execute(
            "SELECT key, value FROM meta WHERE key IN ('policy_version', 'policy_updated_at')"
        ).fetchall()
    )
    version = values.get("policy_version")
    updated = values.get("policy_updated_at")
    return PolicyState(
        int(version) if version is not None else None,
        float(updated) if updated is not None else None,
    )


__all__ = ["SQLiteStore"]
