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
    StoreContents,
    StoreCorruptError,
)

_ROLLOUT_COLUMNS = "id, rollout_id, registration, counters, revision, cancelled"


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

    def contents(self, damage: list[str]) -> StoreContents:
        """What the store found at open (``damage``: found before this was read)."""
        return StoreContents(
            rollouts=[row for _, row in self.rollouts],
            policy=self.policy,
            exits=self.exits,
            exit_cursor=self.exit_cursor,
            damage=[*damage, *self.damage],
        )


@dataclass
class _Last:
    """A rollout's steps as a scan finds them: how many, and the last one's revision and
    counters (the rollout's, after that turn)."""

    count: int = 0
    revision: int = -1
    counters: bytes = b""
    #: The highest step index seen.
    top: int = -1


def _row(found: Any, last: _Last, answer_key: bytes | None) -> tuple[int, RolloutRow]:
    """A rollout's :class:`RolloutRow` from its row (:data:`_ROLLOUT_COLUMNS`), its last
    step and its answer's key: the newer counters of the row's and the last step's."""
    row_id, rollout_id, registration, counters, revision, cancelled = found
    what = f"rollout {rollout_id}"
    reg = codec.decode_json(registration, f"{what} registration")
    if not isinstance(reg, dict) or reg.get("rollout_id") != rollout_id:
        raise StoreCorruptError(f"{what}: its registration names another rollout")
    if last.revision > revision:
        counters, revision = last.counters, last.revision
    state = codec.decode_json(counters, f"{what} counters")
    key = codec.decode_answer_key(answer_key, f"{what} answer") if answer_key else None
    return row_id, RolloutRow(
        cast(Registration, reg), state, int(revision), last.count, key, bool(cancelled)
    )


def load_row(conn: sqlite3.Connection, rollout_id: str) -> RolloutRow | None:
    """The stored rollout ``rollout_id`` (``None``: not stored)."""
    found = conn.execute(
        f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (rollout_id,)
    ).fetchone()
    if found is None:
        return None
    last = _Last()
    step = conn.execute(
        "SELECT idx, revision, counters FROM steps WHERE rollout = ? ORDER BY idx DESC LIMIT 1",
        (found[0],),
    ).fetchone()
    if step is not None:
        last = _Last(step[0] + 1, step[1], step[2])
    key = conn.execute("SELECT answer_key FROM answers WHERE rollout = ?", (found[0],)).fetchone()
    return _row(found, last, key[0] if key is not None else None)[1]


def check_and_load(conn: sqlite3.Connection) -> Loaded:
    """Check the database and read what it holds (see the module doc); damaged rollouts
    are deleted. Raises :class:`~.store.StoreCorruptError` when the database itself is
    damaged (then :func:`salvage` it)."""
    try:
        problems = [r[0] for r in conn.execute("PRAGMA quick_check(20)").fetchall()]
        if problems != ["ok"]:
            raise StoreCorruptError(f"structure check failed: {'; '.join(problems[:5])}")
        bad: dict[int, str] = {}
        lasts = _check_steps(conn, bad)
        keys: dict[int, bytes | None] = {}
        for row_id, key, answer in conn.execute("SELECT rollout, answer_key, answer FROM answers"):
            keys[row_id] = key
            if answer is not None:
                try:
                    codec.unseal(answer, "its last answer")
                except StoreCorruptError as exc:
                    bad[row_id] = str(exc)
        loaded = Loaded()
        names: dict[int, str] = {}
        for found in conn.execute(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts ORDER BY id"):
            row_id = found[0]
            names[row_id] = found[1]
            if row_id in bad:
                continue
            last = lasts.get(row_id, _Last())
            try:
                loaded.rollouts.append(_row(found, last, keys.get(row_id)))
            except StoreCorruptError as exc:
                bad[row_id] = str(exc)
        named = {row_id: (names.get(row_id, f"row {row_id}"), why) for row_id, why in bad.items()}
        _drop(conn, named, loaded.damage)
        loaded.policy, loaded.exit_cursor = _meta(conn)
        loaded.exits = _exits(conn, loaded.damage)
    except sqlite3.DatabaseError as exc:
        raise StoreCorruptError(f"the database cannot be read: {exc}") from None
    return loaded


def _check_steps(conn: sqlite3.Connection, bad: dict[int, str]) -> dict[int, _Last]:
    """Every step's checksums, in the table's order; each rollout's steps counted (the
    unique index makes their indexes distinct: all there when the last is count - 1)."""
    lasts: dict[int, _Last] = {}
    sealed = codec.sealed
    for row_id, index, revision, counters, body in conn.execute(
        "SELECT rollout, idx, revision, counters, body FROM steps"
    ):
        if not (sealed(body) and sealed(counters)):
            bad.setdefault(row_id, f"step {index}: checksum mismatch (damaged or truncated record)")
            continue
        last = lasts.get(row_id)
        if last is None:
            last = lasts[row_id] = _Last()
        last.count += 1
        if index >= last.top:
            last.top, last.revision, last.counters = index, revision, counters
    for row_id, last in lasts.items():
        if row_id not in bad and last.top != last.count - 1:
            bad[row_id] = f"{last.top + 1 - last.count} of its {last.top + 1} steps missing"
    return lasts


def _drop(conn: sqlite3.Connection, bad: dict[int, tuple[str, str]], damage: list[str]) -> None:
    if not bad:
        return
    conn.execute("BEGIN IMMEDIATE")
    for row_id, (rollout_id, reason) in sorted(bad.items()):
        conn.execute("DELETE FROM steps WHERE rollout = ?", (row_id,))
        conn.execute("DELETE FROM answers WHERE rollout = ?", (row_id,))
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


def open_checked(path: Path, synchronous: str) -> tuple[bytes, Loaded, list[str]]:
    """Prepare the database at ``path`` (creating it when new), check it and read it
    back; a damaged one is salvaged first (:func:`salvage`). Returns the store's secret,
    what it holds and what was found damaged (for the log)."""
    damage: list[str] = []
    try:
        conn = connect(path, synchronous)
        try:
            secret = prepare(conn)
            return secret, check_and_load(conn), damage
        finally:
            conn.close()
    except StoreCorruptError as exc:
        damage, loaded = salvage(path, synchronous, str(exc))
    conn = connect(path, synchronous)
    try:
        return prepare(conn), loaded, damage
    finally:
        conn.close()


def salvage(path: Path, synchronous: str, reason: str) -> tuple[list[str], Loaded]:
    """Move the damaged database at ``path`` aside and copy what reads back whole into a
    new one there. Returns what happened (for the log) and what the new one holds."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    damaged = path.with_name(f"{path.name}.damaged-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{path}{suffix}")
        if source.exists():
            source.rename(f"{damaged}{suffix}")
    secret, meta, kept, lost, exits = _read_damaged(damaged)
    new = connect(path, synchronous)
    try:
        prepare(new, secret)
        _copy_into(new, meta, kept, exits)
        loaded = check_and_load(new)
    finally:
        new.close()
    steps_kept = sum(len(rollout.steps) for rollout in kept)
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


def _read_damaged(
    damaged: Path,
) -> tuple[bytes | None, dict[str, Any], list[_Readable], list[str], list[tuple[str, int, bytes]]]:
    """What reads back whole from the damaged database: its secret and meta values, the
    rollouts kept and lost, the exit reports."""
    try:
        old = sqlite3.connect(damaged, isolation_level=None)
        # Read what can be read: SQLite refuses a file shorter than its header says
        # unless told to go on; nothing is written to the damaged file.
        old.execute("PRAGMA writable_schema = ON")
        old.execute("PRAGMA query_only = ON")
    except sqlite3.Error:
        return None, {}, [], [], []
    try:
        secret, meta = _old_meta(old)
        kept, lost = _readable_rollouts(old)
        return secret, meta, kept, lost, _readable_exits(old)
    finally:
        old.close()


def _copy_into(
    new: sqlite3.Connection,
    meta: dict[str, Any],
    kept: list[_Readable],
    exits: list[tuple[str, int, bytes]],
) -> None:
    """Write what was kept of a damaged database into the new one, in one transaction."""
    new.execute("BEGIN IMMEDIATE")
    for key in ("exit_cursor", "policy_version", "policy_updated_at"):
        if key in meta:
            new.execute("UPDATE meta SET value = ? WHERE key = ?", (meta[key], key))
    for rollout in kept:
        row_id = new.execute(
            "INSERT INTO rollouts (rollout_id, key_digest, registration, counters, revision, "
            "cancelled) VALUES (?, ?, ?, ?, ?, ?)",
            rollout.row,
        ).lastrowid
        new.executemany(
            "INSERT INTO steps (rollout, idx, revision, counters, body) VALUES (?, ?, ?, ?, ?)",
            [(row_id, *step) for step in rollout.steps],
        )
        new.execute("INSERT INTO answers VALUES (?, ?, ?)", (row_id, *rollout.answer))
    kept_ids = {rollout.row[0] for rollout in kept}
    new.executemany(
        "INSERT INTO exits (rollout_id, seq, report) VALUES (?, ?, ?)",
        [e for e in exits if e[0] in kept_ids],
    )
    new.execute("COMMIT")


@dataclass
class _Readable:
    """A rollout read whole out of a damaged database, as rows to insert again."""

    row: tuple[Any, ...]  # rollout_id, key_digest, registration, counters, revision, cancelled
    steps: list[tuple[int, int, bytes, bytes]]  # idx, revision, counters, body
    answer: tuple[bytes | None, bytes | None]  # answer_key, answer


def _old_meta(old: sqlite3.Connection) -> tuple[bytes | None, dict[str, Any]]:
    try:
        values = dict(old.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError:
        return None, {}
    secret = values.get("secret")
    if not isinstance(secret, bytes) or len(secret) != 32:
        secret = None
    return secret, values


def _readable_rollouts(old: sqlite3.Connection) -> tuple[list[_Readable], list[str]]:
    """Every rollout whose row, steps and answer read back whole."""
    ids: list[int] = []
    try:
        for found_id in old.execute("SELECT id FROM rollouts"):
            ids.append(found_id[0])
    except sqlite3.DatabaseError:
        pass  # the rows past the damage: not found, so not kept
    kept: list[_Readable] = []
    lost: list[str] = []
    for row_id in ids:
        name = f"row {row_id}"
        try:
            found = old.execute(
                "SELECT rollout_id, key_digest, registration, counters, revision, cancelled "
                "FROM rollouts WHERE id = ?",
                (row_id,),
            ).fetchone()
            name = str(found[0])
            steps = old.execute(
                "SELECT idx, revision, counters, body FROM steps WHERE rollout = ? ORDER BY idx",
                (row_id,),
            ).fetchall()
            if [step[0] for step in steps] != list(range(len(steps))):
                raise StoreCorruptError("steps are missing")
            for index, _, counters, body in steps:
                codec.unseal(body, f"step {index}")
                codec.unseal(counters, f"step {index}'s counters")
            answer = old.execute(
                "SELECT answer_key, answer FROM answers WHERE rollout = ?", (row_id,)
            ).fetchone() or (None, None)
            if answer[1] is not None:
                codec.decode_answer(answer[1], "answer")
            last = _Last(len(steps), *steps[-1][1:3]) if steps else _Last()
            _row((row_id, *found[:1], *found[2:]), last, answer[0])
        except (sqlite3.DatabaseError, StoreCorruptError, TypeError):
            lost.append(name)
            continue
        kept.append(_Readable(tuple(found), [tuple(step) for step in steps], tuple(answer)))
    return kept, lost


def _readable_exits(old: sqlite3.Connection) -> list[tuple[str, int, bytes]]:
    try:
        return [tuple(r) for r in old.execute("SELECT rollout_id, seq, report FROM exits")]
    except sqlite3.DatabaseError:
        return []


__all__ = ["Loaded", "check_and_load", "load_row", "open_checked", "salvage"]
