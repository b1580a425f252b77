"""`rollout-gateway serve` tunes its own process's garbage collector; the library never
tunes the collector of a process it is embedded in (``server/ops/gc_tuning.py``)."""

from __future__ import annotations

import gc
import subprocess
import sys

from rollout_gateway.server.ops.gc_tuning import YOUNG_THRESHOLD

from ..conftest import GatewayHarness, script


def test_tune_for_serving_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    code = (
        "import gc\n"
        "from rollout_gateway.server.ops.gc_tuning import tune_for_serving\n"
        "before = gc.get_threshold()\n"
        "tune_for_serving()\n"
        "print(gc.get_freeze_count(), *gc.get_threshold(), *before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    frozen, young, middle, old, _, middle_before, old_before = map(int, out.stdout.split())
    assert frozen > 10_000  # the interpreter's modules and the package
    assert (young, middle, old) == (YOUNG_THRESHOLD, middle_before, old_before)
    assert gc.isenabled()  # cycles are still collected


async def test_an_embedded_gateway_leaves_the_collector_alone(gw: GatewayHarness) -> None:
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    await gw.register("r1")
    messages = [{"role": "user", "content": script({"say": "hi"})}]
    assert (await gw.chat("r1", messages)).status_code == 200
    assert (gc.get_threshold(), gc.get_freeze_count()) == (threshold, frozen)
