"""The bytes a durable or shared backend stores: steps, answers, registrations, counters.

Every record is *sealed*: its bytes then an 8-byte XXH3-64 of them, checked when read, so a
damaged or truncated record is found (:class:`~.store.StoreCorruptError`) instead of being
served as a wrong trajectory.

A step (:func:`encode_step`) is a fixed header, its token arrays packed, then a JSON
object of its messages and extras. Token ids take 3 bytes each (little-endian) when every
id of the step is below 2**24 (every tokenizer's vocabulary is), else 4 (``int32``);
logprobs 4 bytes each, the ``float32`` the recorder holds, bit for bit. The JSON object is
deflated (:mod:`zlib`, level 1, with the preset dictionary :data:`ZDICT` of the keys and
shapes every step and answer repeats) when that makes it shorter. The header's first byte
is the format version; the JSON object's keys are optional (a reader takes the keys it
knows and ignores the others), so a field added to steps later (a refusal report, routed
experts) is a new key, not a new format. An answer keeps the agent's bytes, without the
prompt's ids when it carried them (they are the step's; :func:`encode_answer`), as they
are: a store keeps only each rollout's last answer, so deflating it would cost every turn
CPU and save little room.

The checksum covers the stored (deflated) bytes; a record whose checksum matches but whose
deflated part does not inflate to the length its header gives is corrupt as well.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from typing import Any

import orjson
import xxhash

from rollout_gateway.server.recording.steps import RecordedStep, StepDelta, TokenDelta
from rollout_gateway.server.state.store import (
    AnswerKey,
    StoreCorruptError,
    StoreVersionError,
    TurnAnswer,
)

#: Version of the step and answer formats (the first byte of each). 2: ids in 3 bytes
#: where they fit, JSON deflated with :data:`ZDICT` (1: 4-byte ids, JSON as is).
FORMAT_VERSION = 2

#: version, flags, shared messages, prefix ids, new prompt ids, completion ids, length of
#: the JSON object (inflated).
_STEP_HEADER = struct.Struct("<BBIIIII")
_HAS_TOKENS, _OVERLONG, _TOKENS_TRUNCATED, _TRUNCATED, _IDS_3, _DEFLATED = 1, 2, 4, 8, 16, 32
_WITHOUT_PROMPT_IDS = 1
_BIG_ENDIAN = sys.byteorder == "big"

#: The preset dictionary of a step's deflated JSON: what steps repeat (keys, roles, the
#: shapes of tool calls and of the recorded facts), the most frequent last (the nearest to
#: the data: the cheapest to refer to). Part of the format: a change is a new
#: :data:`FORMAT_VERSION`.
ZDICT = (
    b'"refusal":null,"annotations":null,"audio":null,"function_call":null,'
    b'"reasoning_content":null,"reasoning":null,"name":"'
    b'{"role":"system","content":"{"role":"user","content":"'
    b'"usage":{"prompt_tokens":,"completion_tokens":,"total_tokens":,'
    b'"prompt_tokens_details":null},"finish_reason":"stop","finish_reason":"length",'
    b'"x":{"timing":{"started_at":,"first_token_s":null,"upstream_s":0.},'
    b'"sampling":{"temperature":,"top_p":,"max_tokens":,"seed":},"policy_version":null,'
    b'"status":"ok","finish_reason":"tool_calls","stop_reason":null,"cached_tokens":null,'
    b'"tools":[],"prefix_break":false}}'
    b'"c":[{"role":"assistant","content":null,"tool_calls":[{"id":"call_",'
    b'"type":"function","function":{"name":"","arguments":"{\\"}}]}],'
    b'{"m":[{"role":"tool","content":"","tool_call_id":"call_'
)
_LEVEL = 1
#: A zlib stream (its header names the dictionary; its trailer's Adler-32 of the inflated
#: bytes is checked when inflating) with an 8 KiB window (its state is then allocated in
#: microseconds; 32 KiB costs tens per record, for a few per cent on the largest only).
_WBITS = 13
#: Parts shorter than this are stored as they are (deflate cannot pay there).
DEFLATE_MIN_BYTES = 64


def seal(payload: bytes) -> bytes:
    """``payload`` with its checksum appended."""
    return payload + xxhash.xxh3_64_digest(payload)


def seal_parts(*parts: bytes | memoryview) -> bytes:
    """The parts joined and sealed, copied once (a step's token arrays are large)."""
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return b"".join((*parts, hasher.digest()))


def sealed(blob: bytes) -> bool:
    """Whether ``blob``'s checksum matches (no copy: for a scan of many records)."""
    return len(blob) >= 8 and xxhash.xxh3_64_digest(memoryview(blob)[:-8]) == blob[-8:]


def unseal(blob: bytes, what: str) -> bytes:
    """The payload of a sealed ``blob`` (raises :class:`StoreCorruptError` naming
    ``what`` when its checksum does not match)."""
    if len(blob) < 8 or xxhash.xxh3_64_digest(memoryview(blob)[:-8]) != blob[-8:]:
        raise StoreCorruptError(f"{what}: checksum mismatch (damaged or truncated record)")
    return blob[:-8]


def encode_json(value: Any) -> bytes:
    """A sealed JSON record (a registration, counters, an exit report)."""
    return seal(orjson.dumps(value))


def decode_json(blob: bytes, what: str) -> Any:
    """The value of a sealed JSON record."""
    try:
        return orjson.loads(unseal(blob, what))
    except orjson.JSONDecodeError as exc:
        raise StoreCorruptError(f"{what}: not JSON ({exc})") from None


#: The compressor's memory level: its hash table and symbol buffer of 2 KiB each (level 8,
#: zlib's default, has 64 KiB of each, and a compressor copied or made for a record of a
#: few kB spent more instructions on them than on the record: a primed compressor's copy,
#: 160 KiB of state, was about 0.16 M instructions a turn). Not part of the format (the
#: stream inflates the same way), and no worse on these records: a record deflates to a
#: block or two of up to 512 symbols each.
_MEM_LEVEL = 3


def deflated(data: bytes) -> bytes | None:
    """``data`` deflated (a zlib stream with :data:`ZDICT`), or ``None`` where that is not
    shorter."""
    if len(data) < DEFLATE_MIN_BYTES:
        return None
    # A new compressor loading the dictionary costs fewer instructions than a copy of a
    # primed one (the copy moves the window and its chains whole).
    packer = zlib.compressobj(
        _LEVEL, zlib.DEFLATED, _WBITS, _MEM_LEVEL, zlib.Z_DEFAULT_STRATEGY, ZDICT
    )
    packed = packer.compress(data) + packer.flush()
    return packed if len(packed) < len(data) else None


def inflated(data: bytes | memoryview, length: int, what: str) -> bytes:
    """What :func:`deflated` made of ``length`` bytes (raises
    :class:`~.store.StoreCorruptError` when it is not that)."""
    unpacker = zlib.decompressobj(_WBITS, ZDICT)
    try:
        out = unpacker.decompress(data, length + 1)
    except zlib.error as exc:
        raise StoreCorruptError(f"{what}: its deflated part is damaged ({exc})") from None
    if len(out) != length or not unpacker.eof or unpacker.unused_data:
        raise StoreCorruptError(f"{what}: its deflated part is not the {length} bytes it names")
    return out


def _ids_in_3(packed: bytes | memoryview) -> bytes | None:
    """Little-endian int32 ids in 3 bytes each, or ``None`` when one needs the fourth."""
    raw = bytes(packed)
    if raw[3::4].count(0) != len(raw) // 4:
        return None
    out = bytearray(len(raw) // 4 * 3)
    out[0::3], out[1::3], out[2::3] = raw[0::4], raw[1::4], raw[2::4]
    return bytes(out)


def _ids_from_3(data: bytes | memoryview) -> bytes:
    raw = bytes(data)
    out = bytearray(len(raw) // 3 * 4)
    out[0::4], out[1::4], out[2::4] = raw[0::3], raw[1::3], raw[2::3]
    return bytes(out)


def _packed(values: array, start: int = 0, end: int | None = None) -> bytes | memoryview:
    """``values[start:end]`` as little-endian bytes (a view, no copy, on this byte order)."""
    if _BIG_ENDIAN:
        values = values[start:end]
        values.byteswap()
        return values.tobytes()
    return memoryview(values)[start:end].cast("B")


def _unpacked(typecode: str, data: bytes | memoryview) -> array:
    values = array(typecode)
    values.frombytes(data)
    if _BIG_ENDIAN:
        values.byteswap()
    return values


def encode_step(step: RecordedStep) -> bytes:
    """A step's sealed bytes: only its ids beyond the prefix it shares (see the module doc)."""
    flags = _TRUNCATED if step.is_truncated else 0
    ids: bytes | memoryview = b""
    logprobs: bytes | memoryview = b""
    prefix = new = completion = 0
    tokens = step.tokens
    if tokens is not None:
        flags |= _HAS_TOKENS
        flags |= _OVERLONG if tokens.overlong_prompt else 0
        flags |= _TOKENS_TRUNCATED if tokens.is_truncated else 0
        prefix = tokens.prefix_len
        new = tokens.prompt_end - prefix
        completion = tokens.completion_end - tokens.prompt_end
        ids = _packed(tokens.segment, prefix, tokens.completion_end)
        logprobs = _packed(tokens.completion_logprobs)
        if len(tokens.completion_logprobs) != completion:
            raise ValueError("a step's logprobs and completion ids differ in length")
        narrow = _ids_in_3(ids)
        if narrow is not None:
            flags |= _IDS_3
            if isinstance(ids, memoryview):
                ids.release()
            ids = narrow
    fields: dict[str, Any] = {"m": step.new_messages, "c": step.completion, "x": step.extras}
    if step.routed_experts is not None:
        fields["r"] = step.routed_experts
    body = orjson.dumps(fields)
    length = len(body)
    packed = deflated(body)
    if packed is not None:
        flags |= _DEFLATED
        body = packed
    header = _STEP_HEADER.pack(
        FORMAT_VERSION, flags, step.shared_messages, prefix, new, completion, length
    )
    try:
        return seal_parts(header, ids, logprobs, body)
    finally:  # views of the arrays must not outlive this call (the branch grows in place)
        for view in (ids, logprobs):
            if isinstance(view, memoryview):
                view.release()


def decode_step(blob: bytes, what: str) -> StepDelta:
    """A step from its sealed bytes."""
    payload = memoryview(unseal(blob, what))
    if not payload:
        raise StoreCorruptError(f"{what}: shorter than a step header")
    if payload[0] != FORMAT_VERSION:
        raise StoreVersionError(
            f"{what}: step format {payload[0]}, this gateway reads {FORMAT_VERSION}"
        )
    if len(payload) < _STEP_HEADER.size:
        raise StoreCorruptError(f"{what}: shorter than a step header")
    _, flags, shared, prefix, new, completion, length = _STEP_HEADER.unpack_from(payload)
    at = _STEP_HEADER.size
    width = 3 if flags & _IDS_3 else 4
    ids_end = at + width * (new + completion)
    json_at = ids_end + 4 * completion
    if json_at > len(payload):
        raise StoreCorruptError(f"{what}: token arrays beyond the record")
    tokens = None
    if flags & _HAS_TOKENS:
        ids = payload[at:ids_end] if width == 4 else _ids_from_3(payload[at:ids_end])
        tokens = TokenDelta(
            prefix,
            _unpacked("i", ids[: 4 * new]),
            _unpacked("i", ids[4 * new :]),
            _unpacked("f", payload[ids_end:json_at]),
            bool(flags & _OVERLONG),
            bool(flags & _TOKENS_TRUNCATED),
        )
    data: bytes | memoryview = payload[json_at:]
    if flags & _DEFLATED:
        data = inflated(data, length, what)
    elif len(data) != length:
        raise StoreCorruptError(f"{what}: its messages are not the {length} bytes it names")
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise StoreCorruptError(f"{what}: messages are not JSON ({exc})") from None
    return StepDelta(
        shared, body.get("m") or [], body.get("c") or [], tokens, bool(flags & _TRUNCATED),
        body.get("x") or {}, body.get("r"),
    )  # fmt: skip


def encode_answer(answer: TurnAnswer) -> bytes:
    """An answer's sealed bytes: the agent's, less the prompt's ids when it had them."""
    body = answer.body
    flags = 0
    if answer.without_prompt_ids is not None:
        data, flags = answer.without_prompt_ids, _WITHOUT_PROMPT_IDS
    elif isinstance(body, bytes):
        data = body
    elif "prompt_token_ids" in body and body["prompt_token_ids"] is not None:
        data, flags = orjson.dumps({**body, "prompt_token_ids": None}), _WITHOUT_PROMPT_IDS
    else:
        data = orjson.dumps(body)
    return seal_parts(bytes((FORMAT_VERSION, flags)), data)


def decode_answer(blob: bytes, what: str) -> tuple[bytes, bool]:
    """An answer's bytes, and whether its ``prompt_token_ids`` were left out (``null``)."""
    payload = unseal(blob, what)
    if len(payload) < 2:
        raise StoreCorruptError(f"{what}: shorter than an answer header")
    if payload[0] != FORMAT_VERSION:
        raise StoreVersionError(
            f"{what}: answer format {payload[0]}, this gateway reads {FORMAT_VERSION}"
        )
    return payload[2:], bool(payload[1] & _WITHOUT_PROMPT_IDS)


_ANSWER_KEY = struct.Struct("<B16sdIH")  # version, fingerprint, finished_at, step, key length


def encode_answer_key(key: AnswerKey) -> bytes:
    """What identifies an answered turn, sealed."""
    idempotency = (key.idempotency_key or "").encode()
    flag = FORMAT_VERSION if key.idempotency_key is not None else FORMAT_VERSION | 0x80
    head = _ANSWER_KEY.pack(flag, key.fingerprint, key.finished_at, key.step, len(idempotency))
    return seal(head + idempotency)


def decode_answer_key(blob: bytes, what: str) -> AnswerKey:
    """An answered turn's identity from its sealed bytes."""
    payload = unseal(blob, what)
    if len(payload) < _ANSWER_KEY.size:
        raise StoreCorruptError(f"{what}: shorter than an answer key")
    flag, fingerprint, finished_at, step, length = _ANSWER_KEY.unpack_from(payload)
    if flag & 0x7F != FORMAT_VERSION:
        raise StoreVersionError(
            f"{what}: answer key format {flag & 0x7F}, this gateway reads {FORMAT_VERSION}"
        )
    raw = payload[_ANSWER_KEY.size : _ANSWER_KEY.size + length]
    if len(raw) != length:
        raise StoreCorruptError(f"{what}: its idempotency key is cut short")
    idempotency = None if flag & 0x80 else raw.decode()
    return AnswerKey(fingerprint, idempotency, finished_at, step)


__all__ = [
    "DEFLATE_MIN_BYTES",
    "FORMAT_VERSION",
    "ZDICT",
    "decode_answer",
    "decode_answer_key",
    "decode_json",
    "decode_step",
    "deflated",
    "encode_answer",
    "encode_answer_key",
    "encode_json",
    "encode_step",
    "inflated",
    "seal",
    "seal_parts",
    "sealed",
    "unseal",
]
