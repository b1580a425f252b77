"""MessageHistory: how many leading messages of a request the recorded history holds.

The text check (a digest of the last recorded request's messages as JSON) is a shortcut:
every answer here must be the one the entry-by-entry comparison gives.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_gateway.server.recording.history import MessageHistory, recorded_message


def _answer(turn: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{turn}", "type": "function",
             "function": {"name": "run", "arguments": f'{{"cmd": "step {turn}"}}'}}
        ],
    }  # fmt: skip


def _record(history: MessageHistory, sent: list[dict[str, Any]], answer: dict[str, Any]) -> int:
    """Match and record one turn as the recorder does; the messages it shared."""
    match = history.match(sent)
    shared = match.shared or 0
    history.advance(match, [recorded_message(m) for m in sent[shared:]], [answer])
    return shared


def _echo(answer: dict[str, Any]) -> dict[str, Any]:
    # What an agent sends back: the answer without its null fields.
    return {k: v for k, v in answer.items() if v is not None}


def _conversation(history: MessageHistory, turns: int) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "start"},
    ]
    for turn in range(turns):
        assert _record(history, sent, _answer(turn)) == (len(sent) - 1 if turn else 0)
        sent = [*sent, _echo(_answer(turn)), {"role": "tool", "tool_call_id": f"c{turn}",
                                               "content": f"out {turn}"}]  # fmt: skip
    return sent


def test_an_agent_repeating_its_messages_shares_all_the_history() -> None:
    history = MessageHistory()
    sent = _conversation(history, 8)
    assert history.match(sent).shared == len(sent) - 1
    assert history.match(sent[:-1]).shared == len(sent) - 1  # no new message


@pytest.mark.parametrize("index", [0, 1, 5, -3])
def test_a_changed_message_anywhere_is_a_rewrite(index: int) -> None:
    history = MessageHistory()
    sent = _conversation(history, 8)
    changed = [dict(m) for m in sent]
    changed[index]["content"] = "something else"
    assert history.match(changed).shared is None


def test_a_changed_echo_of_the_last_answer_is_a_rewrite() -> None:
    # The text check covers the last request's messages; the answer after them is
    # compared with what was recorded.
    history = MessageHistory()
    sent = _conversation(history, 3)
    changed = [dict(m) for m in sent]
    changed[-2] = {**changed[-2], "tool_calls": [{**changed[-2]["tool_calls"][0], "id": "other"}]}
    assert history.match(changed).shared is None
    assert history.match(sent).shared == len(sent) - 1


def test_a_message_that_grew_is_a_rewrite() -> None:
    # The last request's text is a byte prefix of this one's; its messages are not.
    history = MessageHistory()
    sent = [{"role": "user", "content": "ab"}]
    _record(history, sent, {"role": "assistant", "content": "x"})
    assert history.match([{"role": "user", "content": "abc"}]).shared is None
    longer = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "x"}]
    assert history.match(longer).shared == 2


def test_undoing_a_turn_that_rewrote_the_history_restores_the_text_check() -> None:
    history = MessageHistory()
    sent = _conversation(history, 2)
    before = history.snapshot()
    other = [{"role": "user", "content": f"other {i}"} for i in range(len(sent) + 2)]
    assert _record(history, other, _answer(9)) == 0  # a rewrite, recorded...
    history.restore(before)  # ...and undone (its answer reached nobody)
    # A request extending the undone turn's messages does not extend the history kept.
    assert history.match([*other, _echo(_answer(9))]).shared is None
    assert history.match(sent).shared == len(sent) - 1


def test_messages_that_are_not_json_are_still_matched() -> None:
    # Only a caller in Python can pass them; the comparison does without the text check.
    history = MessageHistory()
    sent: list[dict[str, Any]] = [{"role": "user", "content": "a", "meta": {1, 2}}]
    _record(history, sent, {"role": "assistant", "content": "x"})
    assert history.match([*sent, {"role": "assistant", "content": "x"}]).shared == 2
    assert history.match([{"role": "user", "content": "b"}]).shared is None


def test_a_matchs_new_messages_are_trimmed_once_for_the_limits_and_the_recorder() -> None:
    """What a turn's limits count of a request is what the recorder stores: its messages
    after the shared ones, trimmed to the recorded fields, made once."""
    history = MessageHistory()
    first = [{"role": "user", "content": "a", "vendor": 1}]
    match = history.match(first)
    new = match.new_messages(first)
    assert new == [{"role": "user", "content": "a"}]
    assert match.new_messages(first) is new
    history.advance(match, new, [{"role": "assistant", "content": "b"}])
    second = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    again = history.match(second)
    assert again.shared == 2 and again.new_messages(second) == [{"role": "user", "content": "c"}]
    rewritten = history.match([{"role": "user", "content": "z", "cache": True}])
    assert rewritten.shared is None
    assert rewritten.new_messages([{"role": "user", "content": "z", "cache": True}]) == [
        {"role": "user", "content": "z"}
    ]
