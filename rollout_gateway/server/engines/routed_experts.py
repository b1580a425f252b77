"""MoE router replay: the expert routing of a token-in turn, as the trainer reads it.

vLLM started with ``enable_return_routed_experts`` answers ``/inference/v1/generate`` with
each choice's ``routed_experts``: the expert ids its router picked for every position of
the turn's prompt + completion from ``sampling_params.routed_experts_prompt_start`` on
(``[positions, layers, top_k]``; the last sampled token has no forward pass, so no row).
Two encodings are in use:

- prime-rl's inference server (``prime_rl/inference/vllm/routed_experts.py``):
  ``{"data": base64 of the raw array, "shape": [...], "start": int, "dtype": "uint8"}``;
  verifiers v1 (``TurnTokens.routed_experts``, attributed per graph node at commit) and
  verifiers 0.3 (``RoutedExpertsPayload`` on a step's tokens) take exactly this object;
- vLLM's own serving (0.32): a base64 string of the array in ``.npy`` form.

The gateway records the first shape per turn (the second converted to it), aligned to the
turn's tokens by ``start``: positions ``start ..`` of the turn's ``prompt_ids +
completion_ids``. A bridged turn asks for rows from the previous turn's last position
(``routed_experts_prompt_start``, as v1's ``TrainClient``): the prefix's rows are already
recorded, and that one position is the one the previous turn could not route.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping
from typing import Any

#: The generate request's sampling field asking for routing from a position on.
PROMPT_START_FIELD = "routed_experts_prompt_start"


def replay_start(previous_ids: int) -> int:
    """The first position a turn bridged onto ``previous_ids`` prompt + completion ids
    needs routing for (the previous turn's last sampled token had no forward pass)."""
    return max(previous_ids - 1, 0)


def read_routed_experts(choice: Mapping[str, Any], start: int) -> dict[str, Any] | None:
    """A generate choice's routing as ``{"data", "shape", "start", "dtype"}`` (``None``
    when the engine sent none, or something unreadable). ``start`` is the position asked
    for, used when the engine's encoding does not carry it."""
    raw = choice.get("routed_experts")
    if isinstance(raw, Mapping):
        shape = raw.get("shape")
        data = raw.get("data")
        if not isinstance(data, str) or not isinstance(shape, list) or not _is_shape(shape):
            return None
        given = raw.get("start")
        return {
            "data": data,
            "shape": list(shape),
            "start": given if isinstance(given, int) and not isinstance(given, bool) else start,
            "dtype": str(raw.get("dtype") or "uint8"),
        }
    if isinstance(raw, str) and raw:
        return _from_npy(raw, start)
    return None


def _is_shape(shape: Any) -> bool:
    return (
        isinstance(shape, list)
        and len(shape) == 3
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    )


def _from_npy(encoded: str, start: int) -> dict[str, Any] | None:
    """vLLM's ``.npy``-in-base64 routing as the raw-bytes object (numpy comes with the
    ``[tito]`` extra, which token-in mode needs anyway)."""
    try:
        import numpy as np

        array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ImportError, ValueError, OSError, binascii.Error):
        return None
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        return None
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.uint16).max):
        return None
    # uint8 as prime-rl's server sends it; uint16 for models with more than 256 experts.
    dtype = np.uint8 if not array.size or array.max() <= np.iinfo(np.uint8).max else np.uint16
    compact = np.ascontiguousarray(array.astype(dtype, copy=False))
    return {
        "data": base64.b64encode(compact.tobytes()).decode("ascii"),
        "shape": list(compact.shape),
        "start": start,
        "dtype": np.dtype(dtype).name,
    }


__all__ = ["PROMPT_START_FIELD", "read_routed_experts", "replay_start"]
