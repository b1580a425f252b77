"""TokenBranches: each id stored once per branch, the JSON-text path, undo of a turn."""

from __future__ import annotations

from array import array
from typing import Any

import orjson
import pytest

from rollout_gateway.server.recording.token_branches import (
    TokenBranches,
    float32_array,
    int32_array,
)


def test_turns_that_extend_the_branch_share_one_segment():
    ids = TokenBranches()
    first = ids.add(ids.prompt([1, 2, 3], None), [4, 5], [-0.1, -0.2])
    second = ids.add(ids.prompt([1, 2, 3, 4, 5, 6], None), [7], [-0.3])
    assert second.segment is first.segment  # appended in place: each id once
    assert second.prefix_len == 5 and second.prompt_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert second.completion_ids.tolist() == [7]
    assert first.prompt_ids.tolist() == [1, 2, 3] and first.completion_ids.tolist() == [4, 5]
    # A rewritten history starts a new branch and leaves the old one as it was.
    third = ids.add(ids.prompt([1, 9], None), [8], [-0.4])
    assert third.segment is not first.segment and third.prefix_len == 1
    assert first.segment.tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_the_json_text_gives_the_same_ids_as_the_list():
    by_text, by_list = TokenBranches(), TokenBranches()
    prompts = [[5, 6, 7], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10], [5, 1]]
    for prompt in prompts:
        a = by_text.add(by_text.prompt(None, orjson.dumps(prompt)), [0], [0.0])
        b = by_list.add(by_list.prompt(prompt, None), [0], [0.0])
        assert a.prompt_ids.tolist() == b.prompt_ids.tolist() == prompt


def test_a_text_whose_shared_part_differs_is_parsed_whole():
    ids = TokenBranches()
    ids.add(ids.prompt(None, b"[1,2,3]"), [4], [0.0])
    # Same length and an extension's shape, but a different shared part: not reused.
    step = ids.add(ids.prompt(None, b"[1,2,9,4,5]"), [6], [0.0])
    assert step.prompt_ids.tolist() == [1, 2, 9, 4, 5]


def test_restore_drops_the_ids_a_turn_appended():
    ids = TokenBranches()
    ids.add(ids.prompt([1, 2], None), [3], [0.0])
    saved = ids.snapshot()
    ids.add(ids.prompt([1, 2, 3, 4], None), [5], [0.0])
    assert ids.last_ids.tolist() == [1, 2, 3, 4, 5]
    ids.restore(saved)
    assert ids.last_ids.tolist() == [1, 2, 3]


def test_context_bounds_mark_overlong_and_truncated_steps():
    ids = TokenBranches(max_seq_len=4)
    step = ids.add(ids.prompt([1, 2, 3], None), [4, 5], [0.0, 0.0])
    assert not step.overlong_prompt and step.is_truncated
    step = ids.add(ids.prompt([1, 2, 3, 4, 5], None), [6], [0.0])
    assert step.overlong_prompt


def test_ids_that_are_not_32_bit_integers_raise():
    ids = TokenBranches()
    with pytest.raises(OverflowError):
        ids.prompt([2**40], None)
    with pytest.raises(TypeError):
        ids.prompt(None, b'["a"]')


def test_a_text_prompt_that_copies_the_completion_differently_branches_at_the_difference():
    # The engine tokenized the previous completion again, differently ([4, 9], not [4, 5]):
    # the ids known from the previous prompt's text are shared, the rest is compared.
    ids = TokenBranches()
    first = ids.add(ids.prompt(None, b"[1,2,3]"), [4, 5], [0.0, 0.0])
    step = ids.add(ids.prompt(None, b"[1,2,3,4,9,6]"), [7], [0.0])
    assert step.prefix_len == 4 and step.prompt_ids.tolist() == [1, 2, 3, 4, 9, 6]
    assert step.segment is not first.segment and first.segment.tolist() == [1, 2, 3, 4, 5]
    after = ids.add(ids.prompt(None, b"[1,2,3,4,9,6,7,8]"), [0], [0.0])
    assert after.segment is step.segment and after.prefix_len == 7
    assert after.prompt_ids.tolist() == [1, 2, 3, 4, 9, 6, 7, 8]
    # A prompt that is exactly the previous prompt (no completion echoed) shares it.
    again = ids.add(ids.prompt(None, b"[1,2,3,4,9,6,7,8]"), [5], [0.0])
    assert again.prefix_len == 8 and again.prompt_ids.tolist() == [1, 2, 3, 4, 9, 6, 7, 8]


@pytest.mark.parametrize(
    "values",
    [
        [],
        [0, 1, -1, 2**31 - 1, -(2**31), True],
        [1, 2**31],  # beyond 32 bits
        [1, 2.0],  # a float among the ids
        [1, "2"],
        [1, None],
        (3, 4),  # not a list: the array's own conversion
    ],
)
def test_int32_array_gives_what_the_array_gives(values: Any) -> None:
    """The packed conversion of ids gives the array's array, or raises its error type."""
    try:
        expected: Any = array("i", values)
    except Exception as exc:  # noqa: BLE001 - the error type is what is compared
        with pytest.raises(type(exc)):
            int32_array(values)
    else:
        assert int32_array(values) == expected


@pytest.mark.parametrize(
    "values",
    [
        [],
        [-0.5, 0.0, -9999.0, 1, True, float("nan"), float("inf"), float("-inf")],
        [1e300, -1e300, 1e-300],  # beyond float32: the array stores infinities (and 0)
        [1.0, "x"],
        [1.0, None],
    ],
)
def test_float32_array_gives_what_the_array_gives(values: Any) -> None:
    """The packed conversion of logprobs gives the array's array, or its error type."""
    try:
        expected: Any = array("f", values)
    except Exception as exc:  # noqa: BLE001
        with pytest.raises(type(exc)):
            float32_array(values)
    else:
        got = float32_array(values)
        assert got.tobytes() == expected.tobytes()  # NaN compares unequal: the bytes
