"""Cost of containment: the local sandbox backend's isolation modes side by side.

For each mode this host offers (and the uncontained ``process-group`` for reference):
create a sandbox, run ``true`` N times (``execute_command``), delete it; prints the
median / p90 per step and the ratio to ``process-group``.

    python benchmarks/local_sandbox_modes.py [--commands 50] [--sandboxes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from prime_sandboxes import CreateSandboxRequest

from rollout_gateway.local_sandbox import IsolationMode, LocalSandboxClient, unavailable_reasons


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(mode: IsolationMode, root: Path, sandboxes: int, commands: int) -> dict:
    client = LocalSandboxClient(
        root / str(mode),
        isolation=mode,
        reap_interval=None,
        sweep_stale=False,
        register_atexit=False,
    )
    create, run, delete = [], [], []
    try:
        for _ in range(sandboxes):
            t = time.perf_counter()
            sandbox = await client.create(CreateSandboxRequest(name="bench", docker_image="x"))
            create.append(time.perf_counter() - t)
            for _ in range(commands):
                t = time.perf_counter()
                result = await client.execute_command(sandbox.id, "true")
                run.append(time.perf_counter() - t)
                assert result.exit_code == 0, result.stderr
            t = time.perf_counter()
            await client.delete(sandbox.id)
            delete.append(time.perf_counter() - t)
    finally:
        client.teardown()
    return {"create": create, "execute": run, "delete": delete}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=50, help="commands per sandbox")
    parser.add_argument("--sandboxes", type=int, default=5, help="sandboxes per mode")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rg-bench-", dir="/tmp"))
    os.chmod(root, 0o711)
    reasons = unavailable_reasons()
    results = {}
    try:
        for mode in IsolationMode:
            if reasons[mode] is not None:
                print(f"{mode:<14} unavailable: {reasons[mode]}")
                continue
            results[mode] = await measure(mode, root, args.sandboxes, args.commands)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = results.get(IsolationMode.PROCESS_GROUP)
    print(f"{'mode':<14}{'step':<9}{'median ms':>10}{'p90 ms':>9}{'x process-group':>17}")
    for mode, steps in results.items():
        for step, values in steps.items():
            median = statistics.median(values) * 1000
            ratio = median / (statistics.median(base[step]) * 1000) if base else float("nan")
            print(
                f"{mode!s:<14}{step:<9}{median:>10.2f}{pct(values, 0.9) * 1000:>9.2f}{ratio:>17.2f}"
            )


if __name__ == "__main__":
    asyncio.run(main())
