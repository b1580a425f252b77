"""The trajectory's delta form: built, checked and expanded back."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from rollout_gateway import protocol
from rollout_gateway.protocol import BodyError

SYSTEM = {"role": "system", "content": "s"}
USER = {"role": "user", "content": "u"}
CALL = {"role": "assistant", "content": "c"}
RESULT = {"role": "tool", "content": "r", "tool_call_id": "1"}
ANSWER = {"role": "assistant", "content": "a"}


def full_step(prompt: list[Any], answer: dict[str, Any], ids: list[int], out: list[int]):
    return {
        "prompt": prompt,
        "completion": [answer],
        "tokens": {
            "prompt_ids": ids,
            "prompt_mask": [0] * len(ids),
            "completion_ids": out,
            "completion_mask": [1] * len(out),
            "completion_logprobs": [-1.0] * len(out),
            "overlong_prompt": False,
            "is_truncated": False,
        },
        "reward": None,
        "advantage": None,
        "is_truncated": False,
        "trajectory_id": "t",
        "extras": {"tools": []},
    }


STEPS = [
    full_step([SYSTEM, USER], CALL, [1, 2], [3]),
    full_step([SYSTEM, USER, CALL, RESULT], ANSWER, [1, 2, 3, 4], [5, 6]),
]


def test_the_delta_form_holds_only_what_is_new_and_expands_back() -> None:
    delta = protocol.delta_steps(STEPS)  # type: ignore[arg-type]
    assert delta[1]["prompt_shared"] == 3 and delta[1]["prompt_new"] == [RESULT]
    assert delta[1]["tokens"] is not None and delta[1]["tokens"]["prompt_new_ids"] == [4]
    assert "tools" not in delta[1]["extras"]  # as the previous step's: carried forward
    assert protocol.expand_delta_steps(delta) == STEPS


def test_a_step_is_read_with_the_defaults_a_gateway_may_leave_out() -> None:
    step = protocol.parse_delta_step(
        {"prompt_shared": 0, "prompt_new": [USER], "completion": [], "finish_reason": "stop"}
    )
    assert step == {
        "prompt_shared": 0,
        "prompt_new": [USER],
        "completion": [],
        "tokens": None,
        "reward": None,
        "advantage": None,
        "is_truncated": False,
        "trajectory_id": "",
        "extras": {},
        "finish_reason": "stop",  # a field it does not know is kept
    }


@pytest.mark.parametrize(
    ("step", "field"),
    [
        ({"prompt_shared": 0}, "'prompt_new'"),
        ({"prompt_shared": -1, "prompt_new": [], "completion": []}, "'prompt_shared'"),
        ({"prompt_shared": 0, "prompt_new": [], "completion": None}, "'completion'"),
        ({"prompt_shared": 0, "prompt_new": [], "completion": [], "extras": []}, "'extras'"),
        ({"prompt_shared": 0, "prompt_new": [], "completion": [], "tokens": {}}, "'prompt_shared'"),
    ],
)
def test_a_malformed_step_names_its_field(step: dict[str, Any], field: str) -> None:
    with pytest.raises(BodyError, match=field):
        protocol.parse_delta_step(step)
    with pytest.raises(BodyError, match=f"malformed delta step 0: .*{field}"):
        protocol.expand_delta_steps([step])


def test_common_prefix_len_of_lists_and_id_arrays() -> None:
    assert protocol.common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3  # an extension
    assert protocol.common_prefix_len([1, 2, 3, 4], [1, 2]) == 2
    assert protocol.common_prefix_len([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # a fork
    assert protocol.common_prefix_len([], [1]) == 0 and protocol.common_prefix_len([5], [6]) == 0
    ids = array("i", range(1000))
    forked = array("i", [*range(617), -1, *range(618, 1000)])
    assert protocol.common_prefix_len(ids, forked) == 617
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert protocol.common_prefix_len(messages, [messages[0], CALL]) == 1
