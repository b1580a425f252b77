"""The SQLite backend's writers (``rollout_gateway.server.state.sqlite_writer``): the
checkpointer folds the log into the database when commits have grown it, and not on a
timer; a turn is one statement, committed alone without ``BEGIN`` and ``COMMIT`` when it
is alone, and in the pass's transaction when it is not; a failed one leaves nothing."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from rollout_gateway.server.state.sqlite_schema import INSERT_TURN, connect, connect_writer, prepare
from rollout_gateway.server.state.sqlite_writer import Checkpointer, Statement, commit
from rollout_gateway.server.state.store import StoreUnavailableError


def _database_pages(path: Path) -> int:
    # The database file itself (not its log): it grows only when the log is folded in.
    return path.stat().st_size // 4096 if path.exists() else 0


def test_the_log_is_folded_in_at_the_64th_commit_not_on_a_timer(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    conn = connect(path, "normal")
    conn.execute("PRAGMA wal_autocheckpoint = 0")  # as the loop writer's connection
    conn.execute("CREATE TABLE t (x BLOB)")
    for _ in range(20):
        conn.execute("INSERT INTO t VALUES (?)", (b"x" * 50_000,))
    before = _database_pages(path)
    checkpointer = Checkpointer(lambda: connect(path, "normal"), Path(f"{path}-wal"), every_bytes=1)
    checkpointer.start()
    try:
        for _ in range(63):
            checkpointer.committed()
        time.sleep(1.5)  # (the thread polled every second before)
        assert _database_pages(path) == before  # the log not looked at yet
        checkpointer.committed()  # the 64th
        deadline = time.monotonic() + 10
        while _database_pages(path) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _database_pages(path) > before  # folded in: 1 MB of rows in the database
    finally:
        checkpointer.close(10)
        conn.close()
    assert not checkpointer._thread.is_alive()  # close wakes and ends it


def _writer(path: Path) -> tuple[sqlite3.Connection, list[str]]:
    """A writer's connection to a new database with one rollout (row 1), and the
    statements it runs from then on."""
    conn = connect(path, "normal")
    prepare(conn)
    conn.execute(
        "INSERT INTO rollouts (rollout_id, registration, counters, revision, cancelled) "
        "VALUES ('r1', x'00', x'00', 0, 0)"
    )
    conn.execute("INSERT INTO answers (rollout) VALUES (1)")
    conn.close()
    writer = connect_writer(path, "normal")
    ran: list[str] = []
    writer.set_trace_callback(ran.append)
    return writer, ran


def _turn(index: int, answer: bytes | None) -> Statement:
    key = None if answer is None else b"key-%d" % index
    step = b"step-%d" % index
    return Statement(INSERT_TURN, (1, index, index + 1, b"counters", step, key, answer))


def test_a_lone_turn_is_one_statement_committed_without_begin(tmp_path: Path) -> None:
    writer, ran = _writer(tmp_path / "state.db")
    try:
        assert commit(writer, [_turn(0, b"answer-0")], writer.cursor()) == [None]
        assert commit(writer, [_turn(1, None)], writer.cursor()) == [None]  # no answer
        # (SQLite traces the statement again for each statement of its trigger)
        assert ran and all(s.startswith(("INSERT INTO turns ", "--")) for s in ran), ran
    finally:
        writer.close()
    reader = connect(tmp_path / "state.db", "normal")
    steps = reader.execute("SELECT idx, revision, body FROM steps ORDER BY idx").fetchall()
    assert steps == [(0, 1, b"step-0"), (1, 2, b"step-1")]
    # The answer is the last turn's that had one.
    assert reader.execute("SELECT answer_key, answer FROM answers").fetchall() == [
        (b"key-0", b"answer-0")
    ]
    reader.close()


def test_turns_with_other_writes_share_one_transaction(tmp_path: Path) -> None:
    writer, ran = _writer(tmp_path / "state.db")
    try:

        def other(conn: sqlite3.Connection) -> str:
            conn.execute("UPDATE rollouts SET revision = 9")
            return "done"

        assert commit(writer, [_turn(0, b"a0"), other, _turn(1, b"a1")]) == [None, "done", None]
        assert ran[0] == "BEGIN IMMEDIATE" and ran[-1] == "COMMIT"
    finally:
        writer.close()
    reader = connect(tmp_path / "state.db", "normal")
    assert reader.execute("SELECT count(*) FROM steps").fetchone() == (2,)
    assert reader.execute("SELECT answer FROM answers").fetchone() == (b"a1",)
    reader.close()


def test_a_failed_lone_turn_fails_and_leaves_nothing(tmp_path: Path) -> None:
    writer, _ = _writer(tmp_path / "state.db")
    try:
        assert commit(writer, [_turn(0, b"a0")]) == [None]
        # Index 0 again: the step's insert fails (unique), after nothing or before the
        # answer's update: neither is kept.
        (failed,) = commit(writer, [_turn(0, b"other")])
        assert isinstance(failed, StoreUnavailableError)
        assert not writer.in_transaction
    finally:
        writer.close()
    reader = connect(tmp_path / "state.db", "normal")
    assert reader.execute("SELECT body FROM steps").fetchall() == [(b"step-0",)]
    assert reader.execute("SELECT answer FROM answers").fetchone() == (b"a0",)
    reader.close()


def test_bytes_are_bound_through_an_adapter_that_returns_them() -> None:
    # (sqlite3's search for an adapter otherwise raises and clears an AttributeError per
    # bytes parameter: a turn binds four)
    adapter = sqlite3.adapters[(bytes, sqlite3.PrepareProtocol)]
    blob = b"record"
    assert adapter(blob) is blob
    conn = sqlite3.connect(":memory:")
    assert conn.execute("SELECT ?", (blob,)).fetchone() == (blob,)
    conn.close()
