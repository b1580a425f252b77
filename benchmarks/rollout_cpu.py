"""Where a soak rollout's CPU goes outside the deployment: a local sandbox's life and the
example agent's start, in machine CPU seconds.

The chaos soak (``benchmarks/soak.py``) reports each deployment part's CPU per rollout
and the machine's CPU beyond them: the agents and their sandboxes, whose CPU no counter
of the env process holds (bubblewrap's monitor does not hand it on). This splits that
rest. For each step, ``--rounds`` times on a default local sandbox client (the soak's
isolation and limits): create a sandbox (2 GiB of memory, 1 GiB of disk, 1 CPU), run one
command in it, delete it; prints the machine's busy CPU seconds (``/proc/stat``, all
processes: run it on a quiet machine) and the wall seconds per sandbox life.

- ``true``: the sandbox's own cost (directories, file system, cgroup, bubblewrap);
- ``python -c pass``: plus an interpreter's start;
- ``python -c "import openai"``: plus what the example agent
  (``rollout_gateway/examples/fix_bug_env/agent.py``) imports before its first request.

    python benchmarks/rollout_cpu.py [--rounds 10] [--isolation auto]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import sys
import tempfile
import time

from prime_sandboxes import CreateSandboxRequest
from soak import machine_busy_cpu_s

from rollout_gateway.local_sandbox import LocalSandboxClient

#: label -> the command run in the sandbox
STEPS = {
    "true": "true",
    "python -c pass": f"{shlex.quote(sys.executable)} -c pass",
    "import openai": f"{shlex.quote(sys.executable)} -c 'import openai'",
}


async def sandbox_lives(
    client: LocalSandboxClient, command: str, rounds: int
) -> tuple[float, float]:
    """Machine CPU and wall seconds per sandbox life running ``command`` once (the
    machine's CPU counted as the soak counts it, so the figures compare)."""
    request = CreateSandboxRequest(
        name="cpu", docker_image="x", memory_gb=2, disk_size_gb=1, cpu_cores=1
    )
    busy, wall = machine_busy_cpu_s(), time.perf_counter()
    for _ in range(rounds):
        sandbox = await client.create(request)
        result = await client.execute_command(sandbox.id, command)
        await client.delete(sandbox.id)
        if result.exit_code != 0:
            raise SystemExit(f"{command!r} failed in the sandbox: {result.stderr}")
    return (machine_busy_cpu_s() - busy) / rounds, (time.perf_counter() - wall) / rounds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="sandbox lives per step")
    parser.add_argument("--isolation", default="auto", help="the local sandbox mode")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="rg-cpu-", dir="/tmp")
    client = LocalSandboxClient(root, isolation=args.isolation)
    try:
        print(f"isolation {client.isolation}; {args.rounds} sandbox lives per step")
        print(f"{'step':<16} {'machine CPU-s':>14} {'wall s':>8}")
        for label, command in STEPS.items():
            cpu, wall = await sandbox_lives(client, command, args.rounds)
            print(f"{label:<16} {cpu:>14.3f} {wall:>8.3f}")
    finally:
        client.teardown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
