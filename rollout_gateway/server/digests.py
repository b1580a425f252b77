"""Digests the gateway compares every turn: request bodies (retries) and prompt-id texts.

Both are only ever compared within this process, within one rollout: a retry's body with
the turn it repeats (:mod:`.dedupe`), a prompt's id-array text with the previous prompt's
(:mod:`.prompt_ids`, which the recorder only consults for a turn whose messages it has
checked to extend the previous ones). They are 128-bit XXH3 with a secret seed drawn per
process, so an agent cannot aim at a collision. XXH3 instead of SHA-256 because the
texts are large and hashed on every turn: at a 32k context the prompt's id text is
224 kB, and SHA-256 took 0.14 ms of it even with the CPU's SHA instructions (the largest
piece of the gateway's own work that grew with the context); XXH3 takes 0.01 ms.
"""

from __future__ import annotations

import secrets

import xxhash

_SEED = secrets.randbits(64)


def fingerprint(data: bytes) -> bytes:
    """The 16-byte digest of ``data``."""
    return xxhash.xxh3_128_digest(data, seed=_SEED)


def prefix_hasher(data: bytes | memoryview) -> xxhash.xxh3_128:
    """A hasher fed with ``data`` (``update`` it with more, ``digest`` it: the same digest
    as :func:`fingerprint` of all the bytes fed)."""
    return xxhash.xxh3_128(data, seed=_SEED)


__all__ = ["fingerprint", "prefix_hasher"]
