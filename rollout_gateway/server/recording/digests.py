"""Digests the gateway compares every turn: request bodies (retries), and the JSON array
texts of a request's messages and of a prompt's ids.

Within one rollout, a request's messages are compared with the last recorded request's
(:mod:`.history`), and a prompt's id-array text with the previous prompt's
(:mod:`.prompt_ids`, which the recorder only consults for a turn whose messages it has
checked to extend the previous ones). They are 128-bit XXH3 with a secret seed, so an
agent cannot aim at a collision: drawn per process, or, on a gateway whose store other
gateways share, derived from the store's secret (:func:`share_seed`), so that the digests
of a turn one gateway recorded are what another gateway checks the next turn against
(:class:`~.steps.CheckState`, stored beside the step). A retry's body is
compared with the turn it repeats (:mod:`~rollout_gateway.server.state.dedupe`) after a
restart and across gateways too: it is keyed with the store's secret instead
(:func:`keyed_fingerprint`). XXH3 instead of
SHA-256 because the texts are large and hashed on every turn: at a 32k context the
prompt's id text is 224 kB, and SHA-256 took 0.14 ms of it even with the CPU's SHA
instructions (the largest piece of the gateway's own work that grew with the context);
XXH3 takes 0.01 ms.
"""

from __future__ import annotations

import hashlib
import secrets

import xxhash

_SEED = secrets.randbits(64)


def share_seed(secret: bytes) -> None:
    """Key this process's digests with a seed derived from ``secret`` (a shared store's,
    which the gateways on it know and agents do not): the digests one gateway records
    then hold at the others. Digests made before under another seed just stop matching
    (their next check compares the messages instead), never match wrongly."""
    global _SEED
    derived = hashlib.blake2b(secret, digest_size=8, person=b"rg-check-digests").digest()
    _SEED = int.from_bytes(derived, "little")


def fingerprint(data: bytes | memoryview) -> bytes:
    """The 16-byte digest of ``data``."""
    return xxhash.xxh3_128_digest(data, seed=_SEED)


def keyed_fingerprint(data: bytes | memoryview, seed: int) -> bytes:
    """The 16-byte digest of ``data`` under ``seed`` (a secret shared beyond this
    process: request fingerprints that a retry after a restart, or on another gateway,
    must match; see :attr:`~rollout_gateway.server.state.store.RolloutStore.secret`)."""
    return xxhash.xxh3_128_digest(data, seed=seed)


def prefix_hasher(data: bytes | memoryview) -> xxhash.xxh3_128:
    """A hasher fed with ``data`` (``update`` it with more, ``digest`` it: the same digest
    as :func:`fingerprint` of all the bytes fed)."""
    return xxhash.xxh3_128(data, seed=_SEED)


#: A JSON array's text as the next array's text is checked against it: the digest of the
#: text without its closing ``]``, that length, and how many elements the array holds.
ArrayText = tuple[bytes, int, int]


def shared_elements(text: bytes, last: ArrayText | None) -> tuple[int, bytes, int]:
    """How many leading elements the JSON array ``text`` shares with the array ``last``
    describes (all of them, when ``last``'s text up to its ``]`` is a prefix of ``text``
    ending at an element boundary; else 0), then ``text``'s own digest and length without
    its ``]``. One pass over ``text``: the prefix is checked, then the hash extended."""
    body = memoryview(text)[:-1]
    if last is not None:
        digest, length, count = last
        if len(body) >= length and text[length : length + 1] in (b",", b"]"):
            hasher = prefix_hasher(body[:length])
            same = hasher.digest() == digest
            hasher.update(body[length:])
            return (count if same else 0), hasher.digest(), len(body)
    return 0, fingerprint(body), len(body)


__all__ = [
    "ArrayText",
    "fingerprint",
    "keyed_fingerprint",
    "prefix_hasher",
    "share_seed",
    "shared_elements",
]
