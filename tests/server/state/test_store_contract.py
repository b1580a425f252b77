"""The contract every state backend keeps (``rollout_gateway.server.state.store``); the
coordination on each is ``test_coordinator_contract.py``'s.

Parametrised over :data:`store_backends.BACKENDS`: a new backend passes this suite
unchanged. Steps are recorded by a real recorder (branches, a rewritten history, a step
without ids, an abandoned answer) and the trajectory replayed from the store must be the
recorder's, token for token.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_gateway.server.recording.recorder import TrajectoryRecorder
from rollout_gateway.server.state.store import (
    AnswerKey,
    RolloutExistsError,
    RolloutRow,
    RolloutStore,
    TurnAnswer,
    TurnCommit,
    TurnConflictError,
    UnknownRolloutError,
)

from .store_backends import BACKENDS, Backend


@pytest.fixture(params=BACKENDS, ids=[b.name for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param


@pytest.fixture
async def store(backend: Backend, tmp_path: Path) -> Any:
    store = backend.make(tmp_path)
    await store.open()
    yield store
    await store.close()


def row(rollout_id: str = "r1", key: str | None = "d" * 64) -> RolloutRow:
    registration: Any = {
        "rollout_id": rollout_id,
        "model": "policy",
        "sampling_params": {"temperature": 0.5},
        "max_turns": 10,
        "max_seq_len": 4096,
        "upstream": "http://upstream/v1",
        "key_digest": key,
        "trajectory_id": f"traj-{rollout_id}",
        "registered_at": 1.5,
    }
    counters: Any = {"status": "active", "num_turns": 0, "updated_at": time.time()}
    return RolloutRow(registration, counters, revision=0, steps=0)


def counters(num_turns: int, **more: Any) -> Any:
    return {"status": "active", "num_turns": num_turns, "updated_at": time.time(), **more}


def record_turns(recorder: TrajectoryRecorder) -> None:
    """Seven turns: a branch extended in place, a new branch (rewritten history), a turn
    without ids, a refused prompt, non-finite logprobs, extras of every kind, a turn's
    MoE routing."""
    sys_user = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    a1 = {"role": "assistant", "content": "a1", "tool_calls": [{"id": "c1", "type": "function",
          "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}]}  # fmt: skip
    recorder.record(
        sys_user, [a1], prompt_ids=[1, 2, 3], completion_ids=[4, 5],
        completion_logprobs=[-0.5, -0.25], finish_reason="tool_calls",
        extras={"usage": {"prompt_tokens": 3}, "timing": {"upstream_s": 0.01}},
    )  # fmt: skip
    t1 = {"role": "tool", "tool_call_id": "c1", "content": "out é \u2603"}
    messages = [*sys_user, a1, t1]
    a2 = {"role": "assistant", "content": "a2"}
    recorder.record(
        messages, [a2], prompt_ids=[1, 2, 3, 4, 5, 6, 7], completion_ids=[8],
        completion_logprobs=[float("-inf")], finish_reason="length",
    )  # fmt: skip
    messages = [*messages, a2, {"role": "user", "content": "more"}]
    routing = {"data": "AAECAwQF", "shape": [3, 2, 1], "start": 0, "dtype": "uint8"}
    recorder.record(
        messages, [{"role": "assistant", "content": "a3"}], prompt_ids=[1, 2, 3, 9, 10],
        completion_ids=[11, 12, 13], completion_logprobs=[-1.0, -2.0, -3.0],
        routed_experts=routing,  # token-in mode's MoE routing: kept with the step
    )  # fmt: skip
    rewritten = [{"role": "user", "content": "other"}]
    recorder.record(
        rewritten, [{"role": "assistant", "content": "b1"}], prompt_ids=[20, 21],
        completion_ids=[22], completion_logprobs=[-0.125],
    )  # fmt: skip
    recorder.record(
        [*rewritten, {"role": "assistant", "content": "b1"}, {"role": "user", "content": "x"}],
        [{"role": "assistant", "content": "no ids"}], total_tokens=9,
    )  # fmt: skip
    recorder.record_refused(
        [{"role": "user", "content": "too long"}],
        {"status": "error", "error": {"type": "context_length_exceeded"}},
    )
    recorder.record(
        [{"role": "user", "content": "again"}], [{"role": "assistant", "content": "c"}],
        prompt_ids=[30, 31, 2**31 - 1], completion_ids=[-5, 0],
        completion_logprobs=[-0.0, 1e-30],
    )  # fmt: skip


async def commit_all(store: RolloutStore, recorder: TrajectoryRecorder, start: int = 0) -> int:
    revision = 0
    for index in range(start, recorder.num_steps):
        step = recorder._steps[index]
        state = counters(index + 1, abandoned=recorder.abandoned_indexes())
        revision = await store.commit_turn("r1", TurnCommit(index, step, state, None))
    return revision


def replayed(recorder: TrajectoryRecorder, steps: Any, abandoned: Any = ()) -> TrajectoryRecorder:
    again = TrajectoryRecorder(recorder.trajectory_id, recorder.max_seq_len)
    again.replay(steps, set(abandoned))
    return again


async def test_a_new_store_is_empty_and_has_a_secret(store: RolloutStore) -> None:
    assert len(store.secret) == 32
    assert await store.load_rollout("r1") is None
    assert await store.rollout_for_key("d" * 64) is None
    assert (await store.load_policy()).version is None


async def test_rollouts_round_trip_and_ids_are_unique(store: RolloutStore) -> None:
    await store.create_rollout(row())
    loaded = await store.load_rollout("r1")
    assert loaded is not None
    assert loaded.registration == row().registration
    assert loaded.counters["num_turns"] == 0
    assert (loaded.revision, loaded.steps, loaded.cancelled, loaded.answer_key) == (
        0,
        0,
        False,
        None,
    )
    assert await store.rollout_for_key("d" * 64) == "r1"
    with pytest.raises(RolloutExistsError):
        await store.create_rollout(row())
    await store.create_rollout(row("r2", key=None))
    assert (await store.load_rollout("r2")) is not None


async def test_stored_of_names_the_rollouts_still_stored(store: RolloutStore) -> None:
    await store.create_rollout(row("r1"))
    await store.create_rollout(row("r2", key=None))
    assert await store.delete_rollout("r1")
    assert await store.stored_of(["r1", "r2", "never"]) == {"r2"}
    assert await store.stored_of([]) == set()


async def test_a_turn_is_written_once_at_its_index(store: RolloutStore) -> None:
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", 4096)
    record_turns(recorder)
    first = recorder._steps[0]
    revision = await store.commit_turn("r1", TurnCommit(0, first, counters(1), None))
    assert revision == 1
    for wrong in (0, 2):  # the same turn again, or one past a missing turn
        with pytest.raises(TurnConflictError):
            await store.commit_turn("r1", TurnCommit(wrong, first, counters(9), None))
    loaded = await store.load_rollout("r1")
    assert loaded is not None
    assert (loaded.revision, loaded.steps, loaded.counters["num_turns"]) == (1, 1, 1)
    with pytest.raises(UnknownRolloutError):
        await store.commit_turn("nope", TurnCommit(0, first, counters(1), None))


async def test_replayed_steps_are_the_recorded_trajectory(store: RolloutStore) -> None:
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", 4096)
    record_turns(recorder)
    await commit_all(store, recorder)
    steps = await store.load_steps("r1")
    assert len(steps) == recorder.num_steps
    again = replayed(recorder, steps)
    assert orjson.dumps(again.steps()) == orjson.dumps(recorder.steps())
    assert again.delta_steps() == recorder.delta_steps()
    assert again.overview() == recorder.overview()
    assert again.steps()[2]["tokens"]["routed_experts"]["shape"] == [3, 2, 1]
    assert again.last_context_tokens == recorder.last_context_tokens
    assert (await store.load_steps("r1", start=5)) == steps[5:]
    # Logprobs are float32 in memory and in every store: the same values.
    assert steps[1].tokens is not None
    assert steps[1].tokens.completion_logprobs == array("f", [float("-inf")])


async def test_an_abandoned_answer_is_replayed_as_abandoned(store: RolloutStore) -> None:
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", None)
    sys_user = [{"role": "user", "content": "task"}]
    answer = {"role": "assistant", "content": "lost"}
    recorder.record(sys_user, [answer], prompt_ids=[1, 2], completion_ids=[3],
                    completion_logprobs=[-0.5])  # fmt: skip
    await commit_all(store, recorder)
    assert recorder.abandon_last() == 0
    await store.save_rollout("r1", counters(0, abandoned=[0]))
    recorder.record(sys_user, [{"role": "assistant", "content": "seen"}], prompt_ids=[1, 2],
                    completion_ids=[4], completion_logprobs=[-0.25])  # fmt: skip
    await commit_all(store, recorder, start=1)
    loaded = await store.load_rollout("r1")
    assert loaded is not None and loaded.counters["abandoned"] == [0]
    again = replayed(recorder, await store.load_steps("r1"), loaded.counters["abandoned"])
    assert again.steps() == recorder.steps()
    assert again.num_abandoned == 1
    assert [s["completion"][0]["content"] for s in again.steps()] == ["seen"]


async def test_the_answer_of_the_last_turn_is_kept(store: RolloutStore) -> None:
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", None)
    record_turns(recorder)
    assert await store.load_answer("r1") is None
    key = AnswerKey(b"f" * 16, "idem-1", 123.5, 0)
    plain = orjson.dumps({"id": "chatcmpl-1", "choices": [{"message": {"content": "a1"}}]})
    await store.commit_turn(
        "r1", TurnCommit(0, recorder._steps[0], counters(1), TurnAnswer(key, plain))
    )
    stored = await store.load_answer("r1")
    assert stored is not None and stored.body == plain and stored.prompt_ids_of_step is None
    loaded = await store.load_rollout("r1")
    assert loaded is not None and delivered(loaded.answer_key) == key
    # An answer carrying the prompt's ids may be kept without them.
    full = {"id": "chatcmpl-2", "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7], "choices": []}
    without = orjson.dumps({**full, "prompt_token_ids": None})
    key2 = AnswerKey(b"g" * 16, None, 124.0, 1)
    answer = TurnAnswer(key2, orjson.dumps(full), without)
    await store.commit_turn("r1", TurnCommit(1, recorder._steps[1], counters(2), answer))
    stored = await store.load_answer("r1")
    assert stored is not None
    got = orjson.loads(stored.body)
    if stored.prompt_ids_of_step is not None:
        assert stored.prompt_ids_of_step == 1 and got["prompt_token_ids"] is None
        got["prompt_token_ids"] = recorder.prompt_ids_of(1)
    assert got == full
    # A turn with no answer to replay (a refused prompt) leaves the last one.
    await store.commit_turn("r1", TurnCommit(2, recorder._steps[2], counters(3), None))
    loaded = await store.load_rollout("r1")
    assert loaded is not None and delivered(loaded.answer_key) == key2


def delivered(key: AnswerKey | None) -> AnswerKey | None:
    """``key`` as delivered (a store gateways share keeps it undelivered until the
    answering gateway's release says: see test_coordinator_contract.py)."""
    return replace(key, delivered=True) if key is not None else None


async def test_cancel_is_for_good(store: RolloutStore) -> None:
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", None)
    record_turns(recorder)
    revision = await store.cancel_rollout("r1", counters(0, status="cancelled"))
    revision2 = await store.commit_turn(
        "r1", TurnCommit(0, recorder._steps[0], counters(1, status="active"), None)
    )
    revision3 = await store.save_rollout("r1", counters(1, status="active"))
    assert revision < revision2 < revision3
    loaded = await store.load_rollout("r1")
    assert loaded is not None and loaded.cancelled
    with pytest.raises(UnknownRolloutError):
        await store.save_rollout("nope", counters(0))
    with pytest.raises(UnknownRolloutError):
        await store.cancel_rollout("nope", counters(0))


async def test_delete_drops_everything_of_the_rollout(store: RolloutStore) -> None:
    await store.create_rollout(row())
    await store.create_rollout(row("r2", key="e" * 64))
    recorder = TrajectoryRecorder("traj-r1", None)
    record_turns(recorder)
    key = AnswerKey(b"f" * 16, None, 1.0, 0)
    await store.commit_turn(
        "r1", TurnCommit(0, recorder._steps[0], counters(1), TurnAnswer(key, b"{}"))
    )
    await store.save_exit({"rollout_id": "r1", "exit_code": 0, "seq": 1})
    assert await store.delete_rollout("r1")
    assert not await store.delete_rollout("r1")
    assert await store.load_rollout("r1") is None
    assert await store.rollout_for_key("d" * 64) is None
    assert await store.load_answer("r1") is None
    with pytest.raises(UnknownRolloutError):
        await store.load_steps("r1")
    assert await store.load_rollout("r2") is not None
    await store.create_rollout(row())  # the id is free again, with no steps
    assert await store.load_steps("r1") == []


async def test_exit_reports_and_the_policy_version(
    backend: Backend, store: RolloutStore, tmp_path: Path
) -> None:
    await store.create_rollout(row())
    await store.create_rollout(row("r2", key=None))
    await store.save_exit({"rollout_id": "r1", "exit_code": 0, "seq": 1})
    await store.save_exit({"rollout_id": "r2", "exit_code": None, "seq": 2})
    await store.save_exit({"rollout_id": "r1", "exit_code": 3, "seq": 3})
    await store.forget_exit("r2")
    assert (await store.announce_policy(5, 10.0)).version == 5
    assert (await store.announce_policy(4, 11.0)).version == 5  # forward only
    state = await store.announce_policy(5, 12.0)
    assert (state.version, state.updated_at) == (5, 10.0)  # the same again: no change
    assert (await store.load_policy()).version == 5
    if backend.reopen is None:
        return
    again = await backend.reopen(store, tmp_path)
    try:
        contents = await again.open()
        assert contents.exits == [{"rollout_id": "r1", "exit_code": 3, "seq": 3}]
        assert contents.exit_cursor == 3
        assert contents.policy.version == 5
    finally:
        await again.close()


async def test_a_durable_store_keeps_everything_across_a_restart(
    backend: Backend, store: RolloutStore, tmp_path: Path
) -> None:
    if backend.reopen is None:
        pytest.skip(f"{backend.name} is not durable")
    secret = store.secret
    await store.create_rollout(row())
    recorder = TrajectoryRecorder("traj-r1", 4096)
    record_turns(recorder)
    await commit_all(store, recorder)
    key = AnswerKey(b"f" * 16, "k", 99.0, recorder.num_steps - 1)
    await store.save_rollout("r1", counters(7, abandoned=[], failed_turns=[{"after_steps": 1}]))
    await store.cancel_rollout("r1", counters(7, status="cancelled"))
    again = await backend.reopen(store, tmp_path)
    try:
        contents = await again.open()
        assert again.secret == secret
        # (A store gateways share may hold rollouts back: they load them on demand.)
        rows = contents.rollouts or [r for r in [await again.load_rollout("r1")] if r]
        assert [r.registration["rollout_id"] for r in rows] == ["r1"]
        stored = rows[0]
        assert stored.cancelled and stored.steps == recorder.num_steps
        assert stored.counters["num_turns"] == 7
        assert stored.registration == row().registration
        steps = await again.load_steps("r1")
        assert replayed(recorder, steps).steps() == recorder.steps()
        assert await again.rollout_for_key("d" * 64) == "r1"
        assert key.step == recorder.num_steps - 1
    finally:
        await again.close()
