"""A rollout record's one owner: each transition changes the record and is written."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rollout_gateway.protocol import FailedTurn
from rollout_gateway.server.state.ledger import MAX_FAILED_TURNS, RolloutLedger, TurnUse
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.registry import RolloutRecord
from rollout_gateway.server.state.rows import new_row
from rollout_gateway.server.state.sqlite import SQLiteStore
from rollout_gateway.server.state.store import (
    AnswerKey,
    RolloutStore,
    StoreUnavailableError,
    TurnAnswer,
)

FAILED: FailedTurn = {
    "after_steps": 0,
    "error": {"type": "timeout", "message": "slow", "status_code": 504},
    "timing": {"started_at": 0.0, "first_token_s": None, "upstream_s": 1.0},
}


async def setup(store: RolloutStore, max_turns: int = 2) -> tuple[RolloutLedger, RolloutRecord]:
    await store.open()
    record = RolloutRecord("r1", "m", {}, max_turns, None, "http://u", last_activity=0.0)
    await store.create_rollout(new_row(record))
    return RolloutLedger(store, owner="me", wall_clock=time.time), record


def record_step(record: RolloutRecord) -> None:
    history = record.recorder.overview()[0] + record.recorder.overview()[1]
    messages = [*history, {"role": "user", "content": f"u{record.recorder.num_steps}"}]
    record.recorder.record(
        messages, [{"role": "assistant", "content": "a"}],
        prompt_ids=list(range(1, 2 + 2 * record.recorder.num_steps)), completion_ids=[9],
        completion_logprobs=[-0.5],
    )  # fmt: skip


async def stored(store: RolloutStore) -> dict[str, Any]:
    row = await store.load_rollout("r1")
    assert row is not None
    return {**row.counters, "steps": row.steps, "cancelled": row.cancelled}


async def test_a_counted_turn_is_written_with_its_answer_and_completes_at_the_limit() -> None:
    store = MemoryStore()
    ledger, record = await setup(store)
    for turn in range(2):
        record_step(record)
        key = AnswerKey(b"f", None, 0.0, turn)
        use = TurnUse(message_bytes=10, completion_tokens=1)
        await ledger.count_turn(record, use, TurnAnswer(key, b"{}"))
        assert record.answer_key is key
    assert (record.num_turns, record.status, record.message_bytes) == (2, "completed", 20)
    written = await stored(store)
    assert written["num_turns"] == 2 and written["steps"] == 2
    assert written["status"] == "completed" and written["completion_tokens"] == 2
    assert (await store.load_answer("r1")) is not None


async def test_v1_token_caps_count_a_turn_as_v1_counts_it() -> None:
    store = MemoryStore()
    ledger, record = await setup(store, max_turns=-1)
    from rollout_gateway.server.state.limits_v1 import TokenBudget

    record.token_budget = TokenBudget(max_total_tokens=100)
    record_step(record)
    await ledger.count_turn(record, TurnUse(0, 3, v1_tokens=(7, 3)), None)
    assert (record.token_budget.input_tokens, record.token_budget.output_tokens) == (7, 3)
    assert (await stored(store))["input_tokens"] == 7


async def test_an_overflow_ends_the_rollout_truncated() -> None:
    store = MemoryStore()
    ledger, record = await setup(store)
    record.recorder.record_refused([{"role": "user", "content": "long"}], {"status": "error"})
    await ledger.record_overflow(record)
    written = await stored(store)
    assert written["truncation_reason"] == "context_length_exceeded"
    assert written["status"] == "completed" and written["steps"] == 1


async def test_failed_calls_are_kept_the_most_recent_only() -> None:
    store = MemoryStore()
    ledger, record = await setup(store)
    for _ in range(MAX_FAILED_TURNS + 5):
        await ledger.note_failure(record, FAILED)
    assert len(record.failed_turns) == MAX_FAILED_TURNS
    assert len((await stored(store))["failed_turns"]) == MAX_FAILED_TURNS


async def test_the_first_limit_that_refused_a_turn_is_kept_and_written_once() -> None:
    store = MemoryStore()
    ledger, record = await setup(store)
    await ledger.refuse(record, None)  # cancelled or completed: nothing to keep
    assert record.revision == 0
    await ledger.refuse(record, "max_context")
    await ledger.refuse(record, "max_turns")
    assert record.truncation_reason == "max_context" and record.revision == 1
    assert (await stored(store))["truncation_reason"] == "max_context"


@pytest.mark.parametrize("truncated", [False, True])
async def test_an_abandoned_answer_is_no_turn(truncated: bool) -> None:
    store = MemoryStore()
    ledger, record = await setup(store, max_turns=1)
    record_step(record)
    await ledger.count_turn(record, TurnUse(0, 1), None)
    if truncated:
        await ledger.refuse(record, "max_rollout_bytes")
    await ledger.abandon_last(record)
    assert record.num_turns == 0 and record.recorder.abandoned_indexes() == [0]
    assert record.status == ("completed" if truncated else "active")
    assert (await stored(store))["abandoned"] == [0]


async def test_cancel_is_written_for_good() -> None:
    store = MemoryStore()
    ledger, record = await setup(store)
    await ledger.cancel(record)
    assert record.status == "cancelled" and (await stored(store))["cancelled"]


async def test_a_failed_write_leaves_the_record_to_be_reloaded(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state")
    ledger, record = await setup(store)
    await store.close()  # every write now fails
    with pytest.raises(StoreUnavailableError):
        await ledger.note_failure(record, FAILED)
    assert record.revision == -1 and not record.loaded


async def test_transitions_survive_a_restart(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state")
    ledger, record = await setup(store)
    record_step(record)
    await ledger.count_turn(record, TurnUse(5, 1), None)
    await ledger.note_failure(record, FAILED)
    await ledger.refuse(record, "max_context")
    await store.close()
    reopened = SQLiteStore(tmp_path / "state")
    (row,) = (await reopened.open()).rollouts
    assert row.counters["num_turns"] == 1 and row.counters["message_bytes"] == 5
    assert row.counters["truncation_reason"] == "max_context"
    assert row.counters["failed_turns"] == [FAILED]
    await reopened.close()
