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

from typing import Any

import orjson

_KEY = b'"prompt_token_ids"'

#: The JSON text of a prompt's id array: a view into the answer's bytes when cut out of
#: one (at a 32k context 224 kB that need not be copied: only digested and its tail read).
IdsText = bytes | memoryview


def split_prompt_ids(raw: bytes) -> tuple[bytes, memoryview | None]:
    """``(answer with the prompt ids array replaced by null, the array's JSON text)``,
    the text a view into ``raw`` (not a copy).

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
    rest = raw[:open_at] + b"null" + raw[close_at + 1 :]
    return rest, memoryview(raw)[open_at : close_at + 1]


def answer_ids(text: IdsText, read_as_ids: bool) -> Any:
    """The prompt's ids as an agent's answer carries them: when the recorder read
    ``text`` as ids (the step has them), the text itself, written as it is
    (:class:`orjson.Fragment`: at a 32k context parsing it into ints took four times the
    rest of the turn); else parsed (raises ``orjson.JSONDecodeError``)."""
    if read_as_ids:
        return orjson.Fragment(bytes(text))
    return orjson.loads(text)


def id_count(text: IdsText) -> int:
    """How many ids an id array's text holds, without parsing it."""
    body = bytes(text).strip()[1:-1].strip()
    return body.count(b",") + 1 if body else 0


__all__ = ["IdsText", "answer_ids", "id_count", "split_prompt_ids"]
