"""The SQLite backend's writers (``rollout_gateway.server.state.sqlite_writer``): the
checkpointer folds the log into the database when commits have grown it, and not on a
timer."""

from __future__ import annotations

import time
from pathlib import Path

from rollout_gateway.server.state.sqlite_schema import connect
from rollout_gateway.server.state.sqlite_writer import Checkpointer


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
