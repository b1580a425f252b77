"""Limits at work: how long an agent that forks without end, fills its disk or its memory
runs before its local sandbox is stopped, and what creating a sandbox with enforced
limits costs.

Per round and for each runaway agent: create a sandbox with tiny limits (32 processes,
64 MiB of memory, 32 MiB of disk), run the agent's command (``execute_command``), which
ends when the sandbox is stopped at its limit, check the reason on its stderr, delete the
sandbox. Side by side, a well-behaved command (``true``) in a sandbox of the same limits.
Prints the median and p90 per step, and the ratio to the well-behaved command's.

    python benchmarks/local_sandbox_limits.py [--rounds 5] [--isolation auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prime_sandboxes import CreateSandboxRequest

from rollout_gateway.local_sandbox import LocalSandboxClient

MiB = 1024 * 1024

#: name -> (command, what its stderr must name)
AGENTS = {
    "well-behaved": ("true", None),
    "fork bomb": ("b() { b | b & }; b; sleep 600", "process limit (32) reached"),
    "disk fill": (
        "for i in 1 2 3 4 5 6 7 8; do head -c 8388608 /dev/zero > f$i; done; sleep 600",
        "disk limit (32 MiB) reached",
    ),
    "memory hog": (
        f"{sys.executable} -c 'x = bytearray(256 << 20); print(len(x))'; sleep 600",
        "memory limit (64 MiB) reached",
    ),
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of each agent")
    parser.add_argument(
        "--isolation", default="auto", help="isolation mode (default: the strongest here)"
    )
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rg-bench-limits-", dir="/tmp"))
    os.chmod(base, 0o711)
    client = LocalSandboxClient(
        base / "sandboxes",
        isolation=args.isolation,
        reap_interval=0.05,
        sweep_stale=False,
        register_atexit=False,
        pids_limit=32,
    )
    request = CreateSandboxRequest(
        name="bench", docker_image="x", memory_gb=64 / 1024, disk_size_gb=32 / 1024
    )
    times: dict[str, dict[str, list[float]]] = {
        name: {"create": [], "run": [], "delete": []} for name in AGENTS
    }
    try:
        print(f"isolation {client.isolation}; limits enforced here:")
        for limit, how in client.limit_enforcement().items():
            print(f"  {limit:<10} {how}")
        for _ in range(args.rounds):
            for name, (command, reason) in AGENTS.items():  # round by round, side by side
                t = time.perf_counter()
                sandbox = await client.create(request)
                times[name]["create"].append(time.perf_counter() - t)
                t = time.perf_counter()
                result = await client.execute_command(sandbox.id, command, timeout=120)
                times[name]["run"].append(time.perf_counter() - t)
                if reason is not None and reason not in result.stderr:
                    raise SystemExit(f"{name}: not stopped at its limit: {result.stderr[-300:]}")
                t = time.perf_counter()
                await client.delete(sandbox.id)
                times[name]["delete"].append(time.perf_counter() - t)
    finally:
        client.teardown()
        shutil.rmtree(base, ignore_errors=True)
    ok = statistics.median(times["well-behaved"]["run"])
    print(f"\n{args.rounds} rounds; seconds, median (p90); run = command start to its end")
    print(f"{'agent':<14}{'create':>16}{'run':>16}{'run / true':>12}{'delete':>16}")
    for name, steps in times.items():
        cells = [f"{statistics.median(v):.3f} ({pct(v, 0.9):.3f})" for v in steps.values()]
        ratio = statistics.median(steps["run"]) / ok
        print(f"{name:<14}{cells[0]:>16}{cells[1]:>16}{ratio:>11.1f}x{cells[2]:>16}")


if __name__ == "__main__":
    asyncio.run(main())
