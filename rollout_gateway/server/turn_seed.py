"""Per-turn sampling seeds derived from the registered seed.

Sending a rollout's registered ``seed`` unchanged on every turn would give every turn
the same sampling noise (the same random draws at the same positions). Each turn gets
its own seed instead, derived from the registered seed and the turn's number, so a
rollout replayed with the same seed samples the same way turn by turn (a retried turn,
which has the same number, gets the same seed).
"""

from __future__ import annotations

import hashlib

#: Seeds stay within a signed 32-bit range: every engine accepts them.
_SEED_MODULUS = 2**31 - 1


def turn_seed(registered_seed: int, turn_index: int) -> int:
    """The seed of turn ``turn_index`` (0-based) of a rollout registered with ``seed``."""
    digest = hashlib.sha256(f"{registered_seed}:{turn_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % _SEED_MODULUS


__all__ = ["turn_seed"]
