"""Garbage-collector settings for a process that only serves the gateway.

Under ``benchmarks/gateway_overhead.py`` load (64 concurrent rollouts, 1k context),
CPython's cycle collector took about 0.13 ms of the gateway's ~1 ms CPU per turn
(measured with ``gc.callbacks``): each turn allocates thousands of short-lived objects
(the parsed request and answer), so the young generation (700 objects by default) fills
several times per turn, every tenth young collection scans the middle generation, and
now and then a full collection walks every object alive: the ~50k objects of the
interpreter's imports plus every registered rollout's recorded messages.

:func:`tune_for_serving` moves everything alive at start-up (modules, the app) to the
permanent generation (:func:`gc.freeze`), which no collection scans again, and raises the
young generation's threshold to :data:`YOUNG_THRESHOLD`: collections become rarer. Measured
the same way: 0.02 ms of collection per turn instead of 0.13 ms. Reference cycles are still
collected.

The price is longer pauses, less often. A young collection scans what survived since the
last one. Under that load those are mostly the steps recorded meanwhile (about 12 tracked
objects each), so one takes 5-10 ms of CPU (about 17k objects, measured with
``gc.callbacks`` in ``serve``, 64 rollouts at 1k context for 25 s). Each such run also
had one full collection, of 8-22 ms. With the default threshold, young pauses stayed under
2 ms of CPU. But a run then had 16 full collections (up to 34 ms each), and the collector's CPU
per turn was 6x higher.

Only ``rollout-gateway serve`` calls it, for its own process: the library never changes
the collector of a process it is embedded in (tests, demos, an env serving in-process).
"""

from __future__ import annotations

import gc

#: Allocations (net of frees) of container objects between young-generation collections.
YOUNG_THRESHOLD = 20_000


def tune_for_serving() -> None:
    """Collect once, freeze what is alive, and make young collections rarer."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


__all__ = ["YOUNG_THRESHOLD", "tune_for_serving"]
