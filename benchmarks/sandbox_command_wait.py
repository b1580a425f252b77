"""How long after a sandbox's command ends its caller knows: ``execute_command`` of
``sleep S`` minus S, this checkout beside another (``--compare-source``), side by side.

Each side runs in its own process (the other checkout's package first on its path),
the sides alternating round by round; prints the median and p90 of each and their
ratio. A command waited on by polling is seen up to one poll interval late; one waited
on by the kernel's pidfd at once.

    python benchmarks/sandbox_command_wait.py [--commands 30] [--sleep 0.2]
        [--rounds 2] [--compare-source DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


async def measure(commands: int, sleep_s: float) -> list[float]:
    """The extra seconds of each of ``commands`` runs of ``sleep sleep_s``."""
    from prime_sandboxes import CreateSandboxRequest

    from rollout_gateway.local_sandbox import LocalSandboxClient

    root = Path(tempfile.mkdtemp(prefix="rg-wait-"))
    client = LocalSandboxClient(
        root, isolation="process-group", reap_interval=None, register_atexit=False
    )
    extra = []
    try:
        sandbox = await client.create(CreateSandboxRequest(name="bench", docker_image="x"))
        await client.execute_command(sandbox.id, "true")
        for _ in range(commands):
            started = time.perf_counter()
            result = await client.execute_command(sandbox.id, f"sleep {sleep_s}")
            extra.append(time.perf_counter() - started - sleep_s)
            assert result.exit_code == 0, result.stderr
    finally:
        client.teardown()
        shutil.rmtree(root, ignore_errors=True)
    return extra


def run_side(source: Path, args: argparse.Namespace) -> list[float]:
    """One round of one side, in a process whose ``rollout_gateway`` is ``source``'s."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    argv = [sys.executable, __file__, "--child", "--commands", str(args.commands)]
    argv += ["--sleep", str(args.sleep)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=30, help="commands per round")
    parser.add_argument("--sleep", type=float, default=0.2, help="seconds each command runs")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each side")
    parser.add_argument("--compare-source", metavar="DIR", help="another checkout (base)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure(args.commands, args.sleep))))
        return
    sides = {"ours": REPO}
    if args.compare_source:
        sides["base"] = Path(args.compare_source).resolve()
    extra: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, source in sides.items():
            extra[name] += run_side(source, args)
    medians = {}
    for name, values in extra.items():
        medians[name] = statistics.median(values)
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        print(f"{name:5} median {medians[name] * 1000:6.1f} ms  p90 {p90 * 1000:6.1f} ms "
              f"after a command's end ({len(values)} commands of sleep {args.sleep})")  # fmt: skip
    if "base" in medians:
        print(f"ours / base: {medians['ours'] / medians['base']:.2f}x")


if __name__ == "__main__":
    main()
