"""Per-turn digests (``server/digests.py``): one digest per byte string, fed whole or in parts."""

from __future__ import annotations

from rollout_gateway.server.digests import fingerprint, prefix_hasher


def test_a_hasher_fed_in_parts_gives_the_fingerprint_of_the_whole() -> None:
    text = b"[" + b",".join(str(i).encode() for i in range(100_000, 132_000)) + b"]"
    hasher = prefix_hasher(memoryview(text)[:1000])
    prefix_digest = hasher.digest()
    hasher.update(memoryview(text)[1000:])
    assert hasher.digest() == fingerprint(text)
    assert prefix_digest == fingerprint(text[:1000]) != fingerprint(text)
    assert len(fingerprint(b"")) == 16
    changed = text.replace(b"100500", b"100501")
    assert fingerprint(changed) != fingerprint(text)
