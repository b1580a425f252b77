"""Faults the scripted model injects on purpose, and the ledger of what it served.

For soak and chaos runs (``benchmarks/soak.py``): an engine that fails as real ones do,
at rates drawn from a seeded random source so a run can be repeated, and a record of
every completion it answered, so a run can account for every recorded turn.

- ``error_rate``: a 500 with vLLM's error shape, before any work.
- ``slow_rate`` / ``slow_s``: an answer that takes ``slow_s`` seconds longer.
- ``drop_rate``: the connection dropped mid-answer: a streamed answer stops after its
  first chunks without ``[DONE]``; a whole one after its head, with half its body.

:class:`Ledger`: each completion answered in full gets a serial (``usage.call``, unique
across restarts of the model: it starts from the wall clock) that the gateway records in
the step's ``extras.usage``; the ledger file gets one JSON line per answer (``call``,
``at``, the completion's ``id``, a digest of its completion ids). A dropped answer is not
written: it was not served.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

FaultKind = Literal["error", "slow", "drop"]


@dataclass
class FaultPlan:
    """Which requests fail and how (rates in [0, 1], drawn per chat request)."""

    error_rate: float = 0.0
    slow_rate: float = 0.0
    slow_s: float = 5.0
    drop_rate: float = 0.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("error_rate", "slow_rate", "drop_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        self._rng = random.Random(self.seed)

    @property
    def active(self) -> bool:
        """Whether any fault may happen."""
        return bool(self.error_rate or self.slow_rate or self.drop_rate)

    def draw(self) -> FaultKind | None:
        """The fault of the next request, if any."""
        roll = self._rng.random()
        for kind, rate in (
            ("error", self.error_rate),
            ("slow", self.slow_rate),
            ("drop", self.drop_rate),
        ):
            if roll < rate:
                return kind  # type: ignore[return-value]
            roll -= rate
        return None


def completion_digest(completion_ids: list[int]) -> str:
    """A short digest of a completion's ids (what a ledger line and a recorded step share)."""
    return hashlib.blake2b(json.dumps(completion_ids).encode(), digest_size=12).hexdigest()


class Ledger:
    """Serials for the completions the model answers, and their record in a JSONL file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Unique across restarts: a restarted model starts past every earlier serial.
        self._serials = itertools.count(time.time_ns() // 1000)

    def stamp(self, completion: dict[str, Any]) -> int:
        """Give ``completion`` its serial (``usage.call``); returns it."""
        serial = next(self._serials)
        completion.setdefault("usage", {})["call"] = serial
        return serial

    def served(self, completion: dict[str, Any], completion_ids: list[int]) -> None:
        """Record that ``completion`` reached its caller whole."""
        line = {
            "call": completion["usage"]["call"],
            "at": time.time(),
            "id": completion.get("id"),
            "completion": completion_digest(completion_ids),
        }
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


async def dropped_after(chunks: list[bytes], keep: int) -> AsyncIterator[bytes]:
    """The first ``keep`` chunks of an answer, then the connection breaks (the server
    stops mid-body: the client sees a truncated chunked body)."""
    for chunk in chunks[:keep]:
        yield chunk
    raise ConnectionAbortedError("fault: connection dropped mid-answer")


__all__ = ["FaultKind", "FaultPlan", "Ledger", "completion_digest", "dropped_after"]
