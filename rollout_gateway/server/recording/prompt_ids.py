"""The prompt's token ids of an upstream answer, without parsing them every turn.

vLLM answers ``return_token_ids`` with the whole prompt's ids (``prompt_token_ids``): at a
32k context that is a 32k-element JSON array on every turn, and parsing it into Python
ints (then into the recorder's ``array('i')``) was most of the gateway's CPU per turn,
growing with the context. But a multi-turn rollout's prompt nearly always *extends* the
previous turn's prompt, and the engine serialises both the same way. So the recorder
keeps a digest of the previous prompt's array text (see :mod:`.digests`);
:func:`split_prompt_ids` cuts the array text out of the answer (the rest is small and
parsed normally), and the recorder only parses the bytes after the previous prompt when
the digest matches (else the whole array, as before).
"""

from __future__ import annotations

_KEY = b'"prompt_token_ids"'


def split_prompt_ids(raw: bytes) -> tuple[bytes, bytes | None]:
    """``(answer with the prompt ids array replaced by null, the array's JSON text)``.

    ``(raw, None)`` when the answer has no top-level-looking ``"prompt_token_ids": [...]``.
    A quoted key cannot occur inside a JSON string (its quotes would be escaped).
    """
    start = raw.find(_KEY)
    if start < 0:
        return raw, None
    open_at = raw.find(b"[", start + len(_KEY))
    if open_at < 0 or raw[start + len(_KEY) : open_at].strip() != b":":
        return raw, None
    close_at = raw.find(b"]", open_at)
    if close_at < 0:
        return raw, None
    return raw[:open_at] + b"null" + raw[close_at + 1 :], raw[open_at : close_at + 1]


__all__ = ["split_prompt_ids"]
