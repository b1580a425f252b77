"""Reading a rollout's steps and last answer back from the SQLite store's database
(:class:`~.sqlite.SQLiteStore` calls these on its reader connection)."""

from __future__ import annotations

import sqlite3

from rollout_gateway.server.recording.steps import StepDelta
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.store import StoreCorruptError, StoredAnswer


def read_steps(
    conn: sqlite3.Connection, rollout_id: str, row_id: int, start: int, committed: int
) -> list[StepDelta]:
    """The steps of the rollout stored as ``row_id`` from ``start`` on, each checked;
    :class:`~.store.StoreCorruptError` when one is missing or damaged, or when they are
    not the ``committed`` steps."""
    found = conn.execute(
        "SELECT idx, body FROM steps WHERE rollout = ? AND idx >= ? ORDER BY idx",
        (row_id, start),
    ).fetchall()
    steps = []
    for expected, (index, body) in enumerate(found, start):
        if index != expected:
            raise StoreCorruptError(f"rollout {rollout_id}: step {expected} is missing")
        steps.append(codec.decode_step(body, f"rollout {rollout_id} step {index}"))
    if start + len(steps) != committed:
        raise StoreCorruptError(
            f"rollout {rollout_id}: {start + len(steps)} steps stored, {committed} committed"
        )
    return steps


def read_answer(conn: sqlite3.Connection, rollout_id: str, row_id: int) -> StoredAnswer | None:
    """The last answer of the rollout stored as ``row_id`` (without the prompt's ids when
    it had them; ``None``: none stored)."""
    found = conn.execute(
        "SELECT answer_key, answer FROM answers WHERE rollout = ?", (row_id,)
    ).fetchone()
    if found is None or found[1] is None:
        return None
    what = f"rollout {rollout_id} answer"
    key = codec.decode_answer_key(found[0], what)
    body, without_prompt_ids = codec.decode_answer(found[1], what)
    return StoredAnswer(body, key.step if without_prompt_ids else None)


__all__ = ["read_answer", "read_steps"]
