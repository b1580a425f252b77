"""The last step's check state, as the Redis store keeps it beside the step.

Beside the last step, the commit stores what the recording gateway checks the next turn
against (the step's :class:`~rollout_gateway.server.recording.steps.CheckState`, packed by
:func:`encode_check`); the claim reads it along with the steps a gateway's copy missed
(:data:`~.scripts.CLAIM`), and the copy replayed up to that step checks the next request
as cheaply as the recording gateway would.
"""

from __future__ import annotations

import struct

from rollout_gateway.server.recording.digests import ArrayText
from rollout_gateway.server.recording.steps import CheckState, StepDelta
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.store import StoreCorruptError

#: version, step index, then per digest: whether there is one, the digest, the text's
#: length, the element count.
_CHECK = struct.Struct("<BIB16sIIB16sII")
_CHECK_VERSION = 1
_NO_TEXT: tuple[bool, bytes, int, int] = (False, bytes(16), 0, 0)


def _packed_text(text: ArrayText | None) -> tuple[bool, bytes, int, int]:
    return _NO_TEXT if text is None else (True, *text)


def encode_check(index: int, check: CheckState | None) -> bytes:
    """Step ``index``'s check state, sealed (``b""``: none)."""
    if check is None or (check.messages is None and check.prompt_ids is None):
        return b""
    parts = (*_packed_text(check.messages), *_packed_text(check.prompt_ids))
    return codec.seal(_CHECK.pack(_CHECK_VERSION, index, *parts))


def decode_check(blob: bytes | None) -> tuple[int, CheckState] | None:
    """(step index, check state) of :func:`encode_check`'s bytes; ``None`` for none, or
    for bytes that fail their checks (a hint: the next check just costs more)."""
    if not blob:
        return None
    try:
        payload = codec.unseal(blob, "check state")
        version, index, has_m, dm, lm, cm, has_p, dp, lp, cp = _CHECK.unpack(payload)
    except (StoreCorruptError, struct.error):
        return None
    if version != _CHECK_VERSION:
        return None
    messages = (dm, lm, cm) if has_m else None
    return index, CheckState(messages, (dp, lp, cp) if has_p else None)


def attach_check(steps: list[StepDelta], start: int, blob: bytes | None) -> None:
    """Hand the stored check state to the last of ``steps`` (from index ``start``) when
    it is that step's."""
    check = decode_check(blob) if steps else None
    if check is not None and check[0] == start + len(steps) - 1:
        steps[-1].check = check[1]


__all__ = ["attach_check", "decode_check", "encode_check"]
