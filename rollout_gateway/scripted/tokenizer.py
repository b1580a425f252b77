"""Deterministic byte-level tokenizer of the scripted model.

Token ids (documented so tests and examples can predict them exactly):

* ``0..255``: the UTF-8 bytes of the text;
* ``256`` (:data:`IM_START`): start of a message; ``257`` (:data:`IM_END`): end of a
  message (also the end-of-sequence token the model emits when it stops).

A conversation renders with a ChatML-like template. Each message is
``IM_START + utf8(f"{role}\\n{text}") + IM_END``; the prompt ends with the generation
prompt ``IM_START + utf8("assistant\\n")``. A message's ``text`` is its text content
(string, or the concatenated ``text`` parts of a list) followed by one
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` per tool call. A completion is
``utf8(text) + IM_END`` (``IM_END`` dropped when ``max_tokens`` cuts it short).

The log-probability of token ``t`` is :func:`token_logprob` ``= -0.01 * (1 + t % 50)``.

:class:`ChunkTokenizer` (``scripted-model --bytes-per-token N``) is the same template with
text cut into chunks of ``N`` UTF-8 bytes, one id each (a hash of the chunk, in a real
model's id range): a real tokenizer's bytes per token and ids, for benchmarks that
measure what is stored per token. :data:`BYTES` is the byte tokenizer as an object of the
same shape.
"""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

IM_START = 256
IM_END = 257

_SPECIAL_NAMES = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}


def encode_text(text: str) -> list[int]:
    """Token ids of plain text (its UTF-8 bytes)."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``; special tokens are dropped, invalid UTF-8 is replaced."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def token_str(token_id: int) -> str:
    """Display string of one token (as in ``logprobs.content[].token``)."""
    if token_id in _SPECIAL_NAMES:
        return _SPECIAL_NAMES[token_id]
    return bytes([token_id]).decode("latin-1")


def token_logprob(token_id: int) -> float:
    """Deterministic log-probability the scripted model reports for ``token_id``."""
    return -0.01 * (1 + token_id % 50)


def render_tool_call(name: str, arguments: str) -> str:
    """Text form of one tool call inside a rendered message."""
    try:
        args: Any = json.loads(arguments)
    except (TypeError, ValueError):
        args = arguments
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def message_text(message: Mapping[str, Any]) -> str:
    """Text of a message as the template renders it (content, then tool calls)."""
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    else:
        text = ""
    for call in message.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            continue
        function = call.get("function") or {}
        text += render_tool_call(str(function.get("name", "")), function.get("arguments", ""))
    return text


def encode_message(message: Mapping[str, Any]) -> list[int]:
    """Token ids of one rendered message."""
    role = str(message.get("role", "user"))
    return [IM_START, *encode_text(f"{role}\n{message_text(message)}"), IM_END]


def encode_prompt(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of a whole prompt, generation prompt included."""
    ids: list[int] = []
    for message in messages:
        ids.extend(encode_message(message))
    ids.append(IM_START)
    ids.extend(encode_text("assistant\n"))
    return ids


def prompt_length(messages: Sequence[Mapping[str, Any]]) -> int:
    """``len(encode_prompt(messages))``, without building the ids."""
    length = 1 + len(encode_text("assistant\n"))
    for message in messages:
        role = str(message.get("role", "user"))
        length += 2 + len(f"{role}\n{message_text(message)}".encode())
    return length


def encode_completion(text: str) -> list[int]:
    """Token ids of a full (not truncated) completion: its text then ``IM_END``."""
    return [*encode_text(text), IM_END]


class ByteTokenizer:
    """The byte tokenizer (the module's functions) as an object."""

    bytes_per_token = 1

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """:func:`encode_prompt`."""
        return encode_prompt(messages)

    def prompt_length(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """:func:`prompt_length`."""
        return prompt_length(messages)

    def completion(self, text: str) -> tuple[list[int], list[bytes]]:
        """A full completion's ids (text, then ``IM_END``) and each one's bytes (none for
        ``IM_END``)."""
        ids = encode_completion(text)
        return ids, [bytes([t]) if t < 256 else b"" for t in ids]


#: The byte tokenizer.
BYTES = ByteTokenizer()

#: Ids of :class:`ChunkTokenizer` chunks are below this (a real model's vocabulary size).
CHUNK_VOCAB = 151_936


class ChunkTokenizer(ByteTokenizer):
    """Text in chunks of ``bytes_per_token`` UTF-8 bytes, each one id: ``258 +
    crc32(chunk) % (CHUNK_VOCAB - 258)`` (special tokens as the byte tokenizer's; a
    message's role line and its text are cut apart)."""

    def __init__(self, bytes_per_token: int) -> None:
        if bytes_per_token < 1:
            raise ValueError("bytes_per_token must be at least 1")
        self.bytes_per_token = bytes_per_token

    def pieces(self, text: str) -> list[bytes]:
        """``text``'s chunks."""
        data = text.encode("utf-8")
        n = self.bytes_per_token
        return [data[i : i + n] for i in range(0, len(data), n)]

    def _ids(self, pieces: Iterable[bytes]) -> list[int]:
        span = CHUNK_VOCAB - 258
        return [258 + zlib.crc32(piece) % span for piece in pieces]

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (a few tokenizers, process-long)
    def _message(self, role: str, text: str) -> tuple[int, ...]:
        # The role's line and the text are cut apart: a completion's ids (its text's) are
        # then the ids of its message in the next prompt, as a real template's are.
        return (
            IM_START,
            *self._ids(self.pieces(f"{role}\n")),
            *self._ids(self.pieces(text)),
            IM_END,
        )

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """A whole prompt's ids, generation prompt included."""
        ids: list[int] = []
        for message in messages:
            ids.extend(self._message(str(message.get("role", "user")), message_text(message)))
        ids.append(IM_START)
        ids.extend(self._ids(self.pieces("assistant\n")))
        return ids

    def prompt_length(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """``len(encode_prompt(messages))``."""
        return len(self.encode_prompt(messages))

    def completion(self, text: str) -> tuple[list[int], list[bytes]]:
        """A full completion's ids and each one's bytes (see :class:`ByteTokenizer`)."""
        pieces = self.pieces(text)
        return [*self._ids(pieces), IM_END], [*pieces, b""]


def tokenizer_for(bytes_per_token: int) -> ByteTokenizer:
    """The byte tokenizer for 1, else a :class:`ChunkTokenizer`."""
    return BYTES if bytes_per_token == 1 else ChunkTokenizer(bytes_per_token)


__all__ = [
    "BYTES",
    "CHUNK_VOCAB",
    "IM_END",
    "IM_START",
    "ByteTokenizer",
    "ChunkTokenizer",
    "decode",
    "encode_completion",
    "encode_message",
    "encode_prompt",
    "encode_text",
    "message_text",
    "prompt_length",
    "render_tool_call",
    "token_logprob",
    "token_str",
    "tokenizer_for",
]
