"""How a recorded step is written in Redis (one list entry per step).

A step (its delta, :class:`~rollout_gateway.server.recording.steps.StepDelta`) is framed
as ``b"S"``, the JSON header's length (4 bytes, little endian), the header (messages,
flags, extras, array lengths), then the token arrays' raw bytes (``array('i')`` /
``array('f')``, 4 bytes an element): no per-id text.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

import orjson

from rollout_gateway.server.recording.steps import StepDelta, TokenDelta

_STEP = b"S"
_LEN = struct.Struct("<I")


def encode_step(step: StepDelta) -> bytes:
    """One recorded step as stored."""
    t = step.tokens
    header: dict[str, Any] = {
        "s": step.shared_messages,
        "n": step.new_messages,
        "c": step.completion,
        "t": step.is_truncated,
        "x": step.extras,
    }
    arrays = b""
    if t is not None:
        header["k"] = [
            t.prefix_len, len(t.prompt_new_ids), len(t.completion_ids),
            len(t.completion_logprobs), t.overlong_prompt, t.is_truncated,
        ]  # fmt: skip
        arrays = t.prompt_new_ids.tobytes() + t.completion_ids.tobytes()
        arrays += t.completion_logprobs.tobytes()
    text = orjson.dumps(header)
    return b"".join((_STEP, _LEN.pack(len(text)), text, arrays))


def decode_step(event: bytes) -> StepDelta:
    """A step from :func:`encode_step`'s bytes. Raises ``ValueError`` when damaged."""
    if event[:1] != _STEP:
        raise ValueError(f"unknown event {event[:1]!r}")
    (size,) = _LEN.unpack_from(event, 1)
    start = 1 + _LEN.size
    header = orjson.loads(event[start : start + size])
    tokens = None
    if "k" in header:
        prefix, n_prompt, n_completion, n_logprobs, overlong, truncated = header["k"]
        offset = start + size
        ids = array("i")
        ids.frombytes(event[offset : offset + 4 * (n_prompt + n_completion)])
        logprobs = array("f")
        logprobs.frombytes(event[offset + 4 * (n_prompt + n_completion) :])
        if len(logprobs) != n_logprobs:
            raise ValueError("truncated step event")
        tokens = TokenDelta(
            prefix, ids[:n_prompt], ids[n_prompt:], logprobs, bool(overlong), bool(truncated)
        )
    return StepDelta(header["s"], header["n"], header["c"], tokens, header["t"], header["x"])


__all__ = ["decode_step", "encode_step"]
