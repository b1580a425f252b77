"""Per-turn digests (``server/recording/digests.py``): one digest per byte string, fed whole
or in parts."""

from __future__ import annotations

from rollout_gateway.server.recording.digests import fingerprint, prefix_hasher, shared_elements


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


def _state(text: bytes, count: int) -> tuple[bytes, int, int]:
    _, digest, length = shared_elements(text, None)
    return digest, length, count


def test_shared_elements_counts_a_whole_prefix_of_elements_and_digests_in_one_pass() -> None:
    last = _state(b"[10,20,30]", 3)
    assert shared_elements(b"[10,20,30,40]", last)[0] == 3
    assert shared_elements(b"[10,20,30]", last)[0] == 3  # the same array
    assert shared_elements(b"[10,20,31,40]", last)[0] == 0  # a changed element
    assert shared_elements(b"[10,20,300]", last)[0] == 0  # a prefix inside an element
    assert shared_elements(b"[10,20]", last)[0] == 0  # shorter
    assert shared_elements(b"[10,20,30,40]", None)[0] == 0
    # Whether it matched or not, the new text's state is its own, as if digested afresh.
    for text in (b"[10,20,30,40]", b"[10,20,31,40]", b"[10,20,300]"):
        assert shared_elements(text, last)[1:] == shared_elements(text, None)[1:]
        assert shared_elements(text, None)[1:] == (fingerprint(text[:-1]), len(text) - 1)


def test_a_shared_seed_makes_the_same_digests_in_every_process_on_the_store() -> None:
    """Gateways on one shared store key their check digests with a seed derived from the
    store's secret: one gateway's digest of a text is another's (each process runs this
    derivation; here, twice in one process), and another store's secret gives others."""
    from rollout_gateway.server.recording import digests

    before = digests._SEED
    try:
        digests.share_seed(b"s" * 32)
        first = digests.fingerprint(b"[1,2,3]")
        digests.share_seed(b"s" * 32)
        assert digests.fingerprint(b"[1,2,3]") == first
        last = (digests.fingerprint(b"[1,2,3"), 6, 3)  # "[1,2,3]" as the last text
        assert digests.shared_elements(b"[1,2,3,4]", last)[0] == 3
        digests.share_seed(b"t" * 32)
        assert digests.fingerprint(b"[1,2,3]") != first
    finally:
        digests._SEED = before
