"""A copy of a rollout replayed from another gateway's steps, with the check state stored
beside them, checks the next turn as the recording gateway does: by the same digests,
with the same outcome whether the next request extends the history or diverges from it
(in its messages or in its prompt's ids)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from rollout_gateway.server.recording.recorder import TrajectoryRecorder
from rollout_gateway.server.recording.steps import CheckState, StepDelta

SYSTEM = {"role": "system", "content": "be brief"}


def _turn(
    recorder: TrajectoryRecorder,
    messages: list[dict[str, Any]],
    answer: str,
    prompt_ids: list[int],
) -> None:
    """One turn as the chat path records it: the request's text matched, the engine's
    prompt ids as its JSON text (spaced as vLLM writes them)."""
    text = orjson.dumps(messages)
    history = recorder.match_history(messages, text)
    ids_text = ("[" + ", ".join(map(str, prompt_ids)) + "]").encode()
    recorder.record(
        messages, [{"role": "assistant", "content": answer}], prompt_ids_json=ids_text,
        completion_ids=[900 + len(prompt_ids)], completion_logprobs=[-0.5], history=history,
    )  # fmt: skip


def _deltas(recorder: TrajectoryRecorder, *, checks: str) -> list[StepDelta]:
    """The steps as a store hands them back: each with its check state, only the last
    (what the Redis store keeps), or none (a store that keeps none)."""
    deltas = [step.delta() for step in recorder._steps]
    for index, delta in enumerate(deltas):
        if checks == "none" or (checks == "last" and index < len(deltas) - 1):
            delta.check = None
    return deltas


def _two_turns() -> tuple[TrajectoryRecorder, list[dict[str, Any]]]:
    original = TrajectoryRecorder("t", None)
    messages = [SYSTEM, {"role": "user", "content": "task"}]
    _turn(original, messages, "a0", [1, 2, 3, 4])
    messages = [
        *messages,
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
    ]
    _turn(original, messages, "a1", [1, 2, 3, 4, 904, 5, 6])
    return original, [*messages, {"role": "assistant", "content": "a1"}]


NEXT_TURNS = {
    "extends": lambda m: ([*m, {"role": "user", "content": "u2"}], [1, 2, 3, 4, 904, 5, 6, 907, 7]),
    # An earlier message changed: the history is rewritten, whatever the digests say.
    "messages diverge": lambda m: (
        [SYSTEM, {"role": "user", "content": "another task"}, *m[2:]],
        [1, 2, 3, 4, 904, 5, 6, 907, 7],
    ),
    # The last answer echoed back altered: the digest part matches, the rest does not.
    "answer altered": lambda m: ([*m[:-1], {"role": "assistant", "content": "a1!"}], [1, 2, 9]),
    # The messages extend the history but the engine's ids for them do not.
    "ids diverge": lambda m: ([*m, {"role": "user", "content": "u2"}], [1, 2, 8, 4, 904, 5]),
    "fewer messages": lambda m: (m[:2], [1, 2, 3, 4]),
}


@pytest.mark.parametrize("next_turn", sorted(NEXT_TURNS))
@pytest.mark.parametrize("checks", ["each", "last", "none"])
def test_a_replayed_copy_records_the_next_turn_as_the_original(next_turn: str, checks: str) -> None:
    original, history = _two_turns()
    copy = TrajectoryRecorder("t", None)
    copy.replay(_deltas(original, checks=checks))
    if checks == "none":
        assert copy.check_state == CheckState(None, None)  # compares messages, parses ids
    else:
        assert copy.check_state == original.check_state  # one digest pass, as the original
        assert copy.check_state.messages is not None and copy.check_state.prompt_ids is not None
    messages, ids = NEXT_TURNS[next_turn](history)
    for recorder in (original, copy):
        _turn(recorder, messages, "a2", ids)
    assert copy.steps() == original.steps()
    assert copy.check_state == original.check_state
    last = original.steps()[-1]["extras"]
    if next_turn in ("messages diverge", "answer altered", "fewer messages"):
        assert last.get("history_rewritten") is True
    else:
        assert "history_rewritten" not in last
    breaks = ("answer altered", "ids diverge", "fewer messages")
    assert last.get("prefix_break") is (next_turn in breaks)


def test_a_check_state_that_does_not_fit_the_copy_is_not_trusted() -> None:
    original, history = _two_turns()
    deltas = _deltas(original, checks="last")
    stale = original._steps[0].check  # the first step's: fewer messages and ids
    assert stale is not None
    deltas[-1].check = CheckState(
        (stale.messages[0], stale.messages[1], 99) if stale.messages else None,
        (stale.prompt_ids[0], stale.prompt_ids[1], 99) if stale.prompt_ids else None,
    )
    copy = TrajectoryRecorder("t", None)
    copy.replay(deltas)
    assert copy.check_state == CheckState(None, None)
    messages = [*history, {"role": "user", "content": "u2"}]
    for recorder in (original, copy):
        _turn(recorder, messages, "a2", [1, 2, 3, 4, 904, 5, 6, 907, 7])
    assert copy.steps() == original.steps()


def test_an_abandoned_last_step_falls_back_to_the_check_before_it() -> None:
    original, history = _two_turns()
    copy = TrajectoryRecorder("t", None)
    copy.replay(_deltas(original, checks="each"), abandoned={1})
    original.abandon_last()
    assert copy.check_state == original.check_state
    messages = [
        *history[:2],
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1b"},
    ]
    for recorder in (original, copy):
        _turn(recorder, messages, "a1b", [1, 2, 3, 4, 904, 5, 8])
    assert copy.steps() == original.steps()
