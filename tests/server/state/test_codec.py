"""The stored records' bytes (:mod:`rollout_gateway.server.state.codec`): exact round
trips of token ids, logprobs, masks' flags and messages, the compact forms (3-byte ids,
deflated JSON), and damage found, never decoded into a wrong trajectory."""

from __future__ import annotations

import math
import struct
import time
from array import array

import orjson
import pytest

from rollout_gateway.server.recording.steps import RecordedStep
from rollout_gateway.server.recording.token_branches import StepIds
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.store import (
    AnswerKey,
    StoreCorruptError,
    StoreVersionError,
    TurnAnswer,
)

TOOL_OUTPUT = "\n".join(f"line {i}: collected 12 items; test_{i} PASSED" for i in range(60))


def _step(ids: list[int], logprobs: list[float], *, prefix: int = 0, content: str = "ok",
          overlong: bool = False, truncated: bool = False) -> RecordedStep:  # fmt: skip
    completion = len(logprobs)
    segment = array("i", ids)
    tokens = StepIds(
        segment, prefix, len(ids) - completion, len(ids), array("f", logprobs), overlong, truncated
    )
    user = {"role": "tool", "tool_call_id": "call_1", "content": content}
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    ]}  # fmt: skip
    return RecordedStep(3, [user], [assistant], tokens, truncated, {"finish_reason": "length"})


def _roundtrip(step: RecordedStep) -> None:
    blob = codec.encode_step(step)
    back = codec.decode_step(blob, "step")
    assert step.tokens is not None and back.tokens is not None
    t = step.tokens
    assert back.tokens.prefix_len == t.prefix_len
    assert back.tokens.prompt_new_ids == t.segment[t.prefix_len : t.prompt_end]
    assert back.tokens.completion_ids == t.segment[t.prompt_end : t.completion_end]
    # Bit for bit, not approximately (NaN compares unequal to itself: compare the bytes).
    assert back.tokens.completion_logprobs.tobytes() == t.completion_logprobs.tobytes()
    assert back.tokens.overlong_prompt == t.overlong_prompt
    assert back.tokens.is_truncated == t.is_truncated
    assert back.is_truncated == step.is_truncated
    assert (back.shared_messages, back.new_messages, back.completion, back.extras) == (
        step.shared_messages, step.new_messages, step.completion, step.extras,
    )  # fmt: skip


def test_a_step_round_trips_exactly_with_ids_in_three_bytes() -> None:
    ids = [0, 1, 255, 256, 65535, 65536, 151_000, 2**24 - 1] * 40
    logprobs = [-0.0, -1e-45, -0.1, -3.4e38, -math.inf, math.nan, -1 / 3, -12.5]
    step = _step(ids, logprobs, prefix=5, overlong=True, truncated=True)
    _roundtrip(step)
    four_bytes = 4 * (len(ids) - 5)
    assert len(codec.encode_step(step)) < len(codec.encode_step(_step([2**24] + ids, logprobs)))
    assert len(codec.encode_step(step)) - four_bytes < 4 * len(logprobs) + 400


@pytest.mark.parametrize("big", [2**24, 2**31 - 1, -1, -(2**31)])
def test_ids_that_need_four_bytes_keep_them(big: int) -> None:
    _roundtrip(_step([7, big, 9, 10, big], [-0.5, -0.25]))


def test_a_step_without_tokens_round_trips() -> None:
    step = RecordedStep(0, [{"role": "user", "content": "hi"}], [], None, False, {})
    back = codec.decode_step(codec.encode_step(step), "step")
    assert back.tokens is None and back.new_messages == step.new_messages


def test_long_messages_are_deflated_and_short_ones_kept_as_they_are() -> None:
    long = _step([1, 2, 3], [-0.5], content=TOOL_OUTPUT)
    raw = len(orjson.dumps(long.new_messages))
    assert len(codec.encode_step(long)) < raw / 2
    _roundtrip(long)
    short = RecordedStep(0, [], [], None, False, {})
    blob = codec.encode_step(short)
    assert blob[-8 - len(b'{"m":[],"c":[],"x":{}}') : -8] == b'{"m":[],"c":[],"x":{}}'


def test_an_answer_round_trips_byte_for_byte() -> None:
    body = orjson.dumps({"id": "chatcmpl-1", "choices": [{"message": {"content": TOOL_OUTPUT}}],
                         "prompt_token_ids": None})  # fmt: skip
    key = AnswerKey(b"\0" * 16, None, time.time(), 3)
    blob = codec.encode_answer(TurnAnswer(key, {"x": 1}, without_prompt_ids=body))
    assert codec.decode_answer(blob, "answer") == (body, True)
    plain = codec.encode_answer(TurnAnswer(key, b'{"id":"x"}'))
    assert codec.decode_answer(plain, "answer") == (b'{"id":"x"}', False)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x01
    with pytest.raises(StoreCorruptError, match="checksum mismatch"):
        codec.decode_answer(bytes(flipped), "answer")


def test_a_damaged_deflated_step_is_corrupt_not_decoded() -> None:
    blob = codec.encode_step(_step([1, 2, 3], [-0.5], content=TOOL_OUTPUT))
    flipped = bytearray(blob)
    flipped[len(blob) - 20] ^= 0x40  # inside the deflated part
    with pytest.raises(StoreCorruptError, match="checksum mismatch"):
        codec.decode_step(bytes(flipped), "step")
    # Damage the record's checksum does not see (written damaged): the zlib stream's own
    # check of the inflated bytes finds it.
    with pytest.raises(StoreCorruptError, match="deflated part"):
        codec.decode_step(codec.seal(bytes(flipped[:-8])), "step")
    garbage = blob[: -8 - 30] + b"\xff" * 30
    with pytest.raises(StoreCorruptError, match="deflated part"):
        codec.decode_step(codec.seal(garbage), "step")
    with pytest.raises(StoreCorruptError, match="deflated part"):
        codec.decode_step(codec.seal(blob[:-20]), "step")  # cut short


def test_a_deflated_part_of_another_length_is_corrupt() -> None:
    payload = codec.unseal(codec.encode_step(_step([1], [], content=TOOL_OUTPUT)), "step")
    header = struct.Struct("<BBIIIII")
    fields = list(header.unpack_from(payload))
    fields[-1] -= 1  # the JSON's length, as the header names it
    wrong = header.pack(*fields) + payload[header.size :]
    with pytest.raises(StoreCorruptError, match="not the"):
        codec.decode_step(codec.seal(wrong), "step")


def test_records_of_the_earlier_format_are_refused_not_misread() -> None:
    v1_step = codec.seal(struct.pack("<BBIIII", 1, 0, 0, 0, 0, 0) + b'{"m":[],"c":[],"x":{}}')
    with pytest.raises(StoreVersionError, match="step format 1, this gateway reads 2"):
        codec.decode_step(v1_step, "step")
    v1_answer = codec.seal(bytes((1, 0)) + b'{"id":"x"}')
    with pytest.raises(StoreVersionError, match="answer format 1"):
        codec.decode_answer(v1_answer, "answer")
