"""The SQLite backend's checks at open, and what it keeps of a damaged database.

:func:`check_and_load` runs SQLite's structure check (``PRAGMA quick_check``), then reads
every rollout and every step and checks each record's checksum and that each rollout's
steps are all there. A rollout that fails is dropped (its env's next call gets a 404, and
the env reschedules it as an infrastructure error), never served; the others are kept.
When the database itself is damaged (the structure check fails, a page cannot be read,
the file is not a database), :func:`salvage` moves it aside, copies every rollout that
reads back whole into a new database, and says what it kept and what it lost.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.sqlite_schema import connect, prepare
from rollout_gateway.server.state.store import (
    PolicyState,
    Registration,
    RolloutRow,
    StoreCorruptError,
)

#: The columns :func:`rollout_row` reads.
ROLLOUT_COLUMNS = "id, rollout_id, registration, counters, revision, steps, cancelled, answer_key"

_INDEX_MASK = (1 << 32) - 1


@dataclass
class Loaded:
    """What a database holds, checked."""

    #: (row id, row) of every rollout kept.
    rollouts: list[tuple[int, RolloutRow]] = field(default_factory=list)
    policy: PolicyState = field(default_factory=PolicyState)
    exits: list[ExitReport] = field(default_factory=list)
    exit_cursor: int = 0
    #: What was found damaged and what was done about it.
    damage: list[str] = field(default_factory=list)


def rollout_row(found: Any) -> tuple[int, RolloutRow]:
    """A ``rollouts`` row (:data:`ROLLOUT_COLUMNS`) as (row id, :class:`RolloutRow`)."""
    row_id, rollout_id, registration, counters, revision, steps, cancelled, answer_key = found
    what = f"rollout {rollout_id}"
    reg = codec.decode_json(registration, f"{what} registration")
    if not isinstance(reg, dict) or reg.get("rollout_id") != rollout_id:
        raise StoreCorruptError(f"{what}: its registration names another rollout")
    state = codec.decode_json(counters, f"{what} counters")
    key = codec.decode_answer_key(answer_key, f"{what} answer") if answer_key else None
    registration = cast(Registration, reg)
    return row_id, RolloutRow(registration, state, int(revision), int(steps), key, bool(cancelled))


def check_and_load(conn: sqlite3.Connection) -> Loaded:
    """Check the database and read what it holds (see the module doc); damaged rollouts
    are deleted. Raises :class:`~.store.StoreCorruptError` when the database itself is
    damaged (then :func:`salvage` it)."""
    try:
        problems = [r[0] for r in conn.execute("PRAGMA quick_check(20)").fetchall()]
        if problems != ["ok"]:
            raise StoreCorruptError(f"structure check failed: {'; '.join(problems[:5])}")
        loaded = Loaded()
        bad: dict[str, tuple[int, str]] = {}
        rows: dict[int, RolloutRow] = {}
        for found in conn.execute(f"SELECT {ROLLOUT_COLUMNS} FROM rollouts ORDER BY id"):
            try:
                row_id, row = rollout_row(found)
            except StoreCorruptError as exc:
                bad[found[1]] = (found[0], str(exc))
                continue
            rows[row_id] = row
        counts = _check_steps(conn, rows, bad)
        for row_id, row in rows.items():
            rollout_id = row.registration["rollout_id"]
            if rollout_id in bad:
                continue
            if counts.get(row_id, 0) != row.steps:
                found_steps = counts.get(row_id, 0)
                bad[rollout_id] = (row_id, f"{found_steps} steps stored, {row.steps} committed")
                continue
            loaded.rollouts.append((row_id, row))
        _drop(conn, bad, loaded.damage)
        loaded.policy, loaded.exit_cursor = _meta(conn)
        loaded.exits = _exits(conn, loaded.damage)
    except sqlite3.DatabaseError as exc:
        raise StoreCorruptError(f"the database cannot be read: {exc}") from None
    return loaded


def _check_steps(
    conn: sqlite3.Connection, rows: dict[int, RolloutRow], bad: dict[str, tuple[int, str]]
) -> dict[int, int]:
    """Every step's checksum and index; returns the steps found per rollout row."""
    counts: dict[int, int] = {}
    for key, body in conn.execute("SELECT id, body FROM steps ORDER BY id"):
        row_id, index = key >> 32, key & _INDEX_MASK
        row = rows.get(row_id)
        if row is None:
            continue  # its rollout's row is damaged (reported there)
        rollout_id = row.registration["rollout_id"]
        if rollout_id in bad:
            continue
        expected = counts.get(row_id, 0)
        if index != expected:
            bad[rollout_id] = (row_id, f"step {expected} is missing")
            continue
        try:
            codec.unseal(body, f"rollout {rollout_id} step {index}")
        except StoreCorruptError as exc:
            bad[rollout_id] = (row_id, str(exc))
            continue
        counts[row_id] = index + 1
    return counts


def _drop(conn: sqlite3.Connection, bad: dict[str, tuple[int, str]], damage: list[str]) -> None:
    if not bad:
        return
    conn.execute("BEGIN IMMEDIATE")
    for rollout_id, (row_id, reason) in sorted(bad.items()):
        conn.execute(
            "DELETE FROM steps WHERE id BETWEEN ? AND ?",
            (row_id << 32, (row_id << 32) | _INDEX_MASK),
        )
        conn.execute("DELETE FROM rollouts WHERE id = ?", (row_id,))
        conn.execute("DELETE FROM exits WHERE rollout_id = ?", (rollout_id,))
        damage.append(f"rollout {rollout_id} is damaged ({reason}): dropped, not served")
    conn.execute("COMMIT")


def _meta(conn: sqlite3.Connection) -> tuple[PolicyState, int]:
    values = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    version, updated = values.get("policy_version"), values.get("policy_updated_at")
    policy = PolicyState(
        int(version) if version is not None else None,
        float(updated) if updated is not None else None,
    )
    return policy, int(values.get("exit_cursor") or 0)


def _exits(conn: sqlite3.Connection, damage: list[str]) -> list[ExitReport]:
    exits: list[ExitReport] = []
    for rollout_id, blob in conn.execute("SELECT rollout_id, report FROM exits ORDER BY seq"):
        try:
            exits.append(cast(ExitReport, codec.decode_json(blob, f"exit report of {rollout_id}")))
        except StoreCorruptError as exc:
            damage.append(f"{exc}: dropped")
    return exits


def salvage(path: Path, synchronous: str, reason: str) -> tuple[list[str], Loaded]:
    """Move the damaged database at ``path`` aside and copy what reads back whole into a
    new one there. Returns what happened (for the log) and what the new one holds."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    damaged = path.with_name(f"{path.name}.damaged-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{path}{suffix}")
        if source.exists():
            source.rename(f"{damaged}{suffix}")
    kept: list[tuple[str, Any, list[tuple[int, bytes]]]] = []
    lost: list[str] = []
    secret: bytes | None = None
    meta: dict[str, Any] = {}
    exits: list[tuple[str, int, bytes]] = []
    try:
        old = sqlite3.connect(damaged, isolation_level=None)
        # Read what can be read: SQLite refuses a file shorter than its header says
        # unless told to go on; nothing is written to the damaged file.
        old.execute("PRAGMA writable_schema = ON")
        old.execute("PRAGMA query_only = ON")
    except sqlite3.Error:
        old = None
    if old is not None:
        try:
            secret, meta = _old_meta(old)
            kept, lost = _readable_rollouts(old)
            exits = _readable_exits(old)
        finally:
            old.close()
    new = connect(path, synchronous)
    try:
        prepare(new, secret)
        new.execute("BEGIN IMMEDIATE")
        for key in ("exit_cursor", "policy_version", "policy_updated_at"):
            if key in meta:
                new.execute("UPDATE meta SET value = ? WHERE key = ?", (meta[key], key))
        for found, _, steps in kept:
            cursor = new.execute(
                "INSERT INTO rollouts (rollout_id, key_digest, registration, counters, revision, "
                "steps, cancelled, answer_key, answer) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                found,
            )
            row_id = cursor.lastrowid
            assert row_id is not None
            new.executemany(
                "INSERT INTO steps (id, body) VALUES (?, ?)",
                [((row_id << 32) | index, body) for index, body in steps],
            )
        kept_ids = {found[0] for found, _, _ in kept}
        new.executemany(
            "INSERT INTO exits (rollout_id, seq, report) VALUES (?, ?, ?)",
            [e for e in exits if e[0] in kept_ids],
        )
        new.execute("COMMIT")
        loaded = check_and_load(new)
    finally:
        new.close()
    steps_kept = sum(len(steps) for _, _, steps in kept)
    report = [
        f"the state database was damaged ({reason}); it is kept as {damaged}",
        f"recovered {len(kept)} rollouts ({steps_kept} steps) into a new {path.name}",
    ]
    if lost:
        report.append(
            f"lost {len(lost)} rollouts (not served; their envs get 404): {', '.join(lost)}"
        )
    if secret is None:
        report.append("the store's secret was lost: retries from before the restart run again")
    return [*report, *loaded.damage], loaded


def _old_meta(old: sqlite3.Connection) -> tuple[bytes | None, dict[str, Any]]:
    try:
        values = dict(old.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError:
        return None, {}
    secret = values.get("secret")
    if not isinstance(secret, bytes) or len(secret) != 32:
        secret = None
    return secret, values


def _readable_rollouts(
    old: sqlite3.Connection,
) -> tuple[list[tuple[Any, RolloutRow, list[tuple[int, bytes]]]], list[str]]:
    """Every rollout whose row and steps read back whole (rows as insertable tuples)."""
    ids: list[int] = []
    try:
        for found_id in old.execute("SELECT id FROM rollouts"):
            ids.append(found_id[0])
    except sqlite3.DatabaseError:
        pass  # the rows past the damage: not found, so not kept
    kept: list[tuple[Any, RolloutRow, list[tuple[int, bytes]]]] = []
    lost: list[str] = []
    for row_id in ids:
        name = f"row {row_id}"
        try:
            found = old.execute(
                f"SELECT {ROLLOUT_COLUMNS}, key_digest, answer FROM rollouts WHERE id = ?",
                (row_id,),
            ).fetchone()
            name = str(found[1])
            _, row = rollout_row(found[:8])
            steps = old.execute(
                "SELECT id, body FROM steps WHERE id BETWEEN ? AND ? ORDER BY id",
                (row_id << 32, (row_id << 32) | _INDEX_MASK),
            ).fetchall()
            indexed = [(key & _INDEX_MASK, bytes(body)) for key, body in steps]
            if [i for i, _ in indexed] != list(range(row.steps)):
                raise StoreCorruptError("steps are missing")
            for index, body in indexed:
                codec.unseal(body, f"step {index}")
            if found[9] is not None:
                codec.decode_answer(found[9], "answer")
        except (sqlite3.DatabaseError, StoreCorruptError, TypeError):
            lost.append(name)
            continue
        insertable = (
            found[1],
            found[8],
            found[2],
            found[3],
            found[4],
            found[5],
            found[6],
            found[7],
            found[9],
        )
        kept.append((insertable, row, indexed))
    return kept, lost


def _readable_exits(old: sqlite3.Connection) -> list[tuple[str, int, bytes]]:
    try:
        return [tuple(r) for r in old.execute("SELECT rollout_id, seq, report FROM exits")]
    except sqlite3.DatabaseError:
        return []


__all__ = ["ROLLOUT_COLUMNS", "Loaded", "check_and_load", "rollout_row", "salvage"]
