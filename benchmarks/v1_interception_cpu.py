"""CPU per turn on verifiers v1: v1's own interception vs gateway mode, same v1 task.

Runs the ``fix-bug-v1`` example (its agent is a real subprocess on v1's subprocess
runtime) from this process, the *env process*, twice side by side:

- ``v1``: v1's own ``InterceptionServer`` in the env process relays every model call to
  the scripted model;
- ``gateway``: :class:`rollout_gateway.v1.GatewayInterception`; the agents call the
  reference gateway (its own process) directly, the env only registers, syncs the trace
  and unregisters.

The scripted model and the gateway run as separate processes (``rollout-gateway`` CLI).
Reported per model turn: env-process CPU (``getrusage(SELF)``), agent CPU (the harness
programs and reward checks, ``getrusage(CHILDREN)``), gateway and model process CPU
(``/proc``), and their total. Both modes run the same tasks, rollouts and concurrency.

    python benchmarks/v1_interception_cpu.py [--rollouts 24] [--concurrency 8] [--repeat 2]
        [--turns 0]

``--turns N`` replaces the example's 4-turn tasks by one task of N turns (N-1 cheap shell
calls, then an answer), so per-turn costs dominate the per-rollout ones.

Needs ``rollout-gateway[v1]`` and ``examples/fix_bug_v1`` installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarnessConfig, FixBugTask, FixBugTaskset
from fix_bug_v1.tasks import FixBugData, task_prompt
from gateway_overhead import _free_port, _proc_stat, _process
from verifiers.v1.interception import InterceptionServer

from rollout_gateway.v1 import (
    GatewayInterception,
    GatewayInterceptionConfig,
    gateway_synced_agent,
)

ADMIN_TOKEN = "benchmark-admin-token-0123456789"


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process (gateway_overhead's per-process clock)."""
    return _proc_stat(pid)[0]


def _cli(args: list[str], health_url: str) -> contextlib.AbstractContextManager[int]:
    """A ``rollout-gateway`` subcommand as its own process, ready; yields its pid."""
    cmd = [sys.executable, "-m", "rollout_gateway.cli", *args, "--log-level", "warning"]
    return _process(cmd, health_url)


@dataclass
class Sample:
    """CPU seconds and turns of one measured run."""

    mode: str
    turns: int
    wall_s: float
    env_s: float
    agents_s: float
    gateway_s: float
    model_s: float

    @property
    def total_s(self) -> float:
        return self.env_s + self.agents_s + self.gateway_s + self.model_s

    def per_turn_ms(self, seconds: float) -> float:
        return 1000 * seconds / max(1, self.turns)


def _rusage() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _tasks(turns: int) -> list[Any]:
    if turns <= 0:
        return list(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1")))
    steps: list[Any] = [
        {"tool": "run_shell", "arguments": {"command": f"echo step {i}"}} for i in range(turns - 1)
    ]
    steps.append({"say": "done"})
    data = FixBugData(
        id="long", prompt=task_prompt("Benchmark task.", steps), files={}, test_command="true"
    )
    return [FixBugTask(data)]


async def _rollouts(
    interception: Any, base_url: str, *, sync: bool, rollouts: int, concurrency: int, turns: int
) -> int:
    config = vf.AgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=base_url),
        harness=FixBugHarnessConfig(max_agent_turns=max(10, turns)),
        runtime=vf.SubprocessConfig(),
    )
    tasks = _tasks(turns)
    gate = asyncio.Semaphore(concurrency)
    agent = vf.Agent(config, interception=interception)
    if sync:
        gateway_synced_agent(agent, interception)

    async def one(i: int) -> int:
        async with gate:
            trace = await agent.run(tasks[i % len(tasks)])
        if not trace.ok:
            raise RuntimeError(f"rollout failed: {trace.errors}")
        return trace.num_turns

    async with agent:
        return sum(await asyncio.gather(*(one(i) for i in range(rollouts))))


async def _measure(mode: str, args: argparse.Namespace, procs: dict[str, Any]) -> Sample:
    model_url, gateway_url = procs["model_url"], procs["gateway_url"]
    async with contextlib.AsyncExitStack() as stack:
        if mode == "v1":
            interception: Any = InterceptionServer(requires_tunnel=False)
            base_url, sync = f"{model_url}/v1", False
        else:
            interception = GatewayInterception(
                GatewayInterceptionConfig(tunnel="direct"), admin_token=ADMIN_TOKEN
            )
            base_url, sync = f"{gateway_url}/v1", True
        await stack.enter_async_context(interception)
        await _rollouts(  # warm-up
            interception, base_url, sync=sync, rollouts=2, concurrency=2, turns=args.turns
        )
        env0, kids0 = _rusage()
        gw0, model0 = _cpu_s(procs["gateway"]), _cpu_s(procs["model"])
        start = time.perf_counter()
        turns = await _rollouts(
            interception,
            base_url,
            sync=sync,
            rollouts=args.rollouts,
            concurrency=args.concurrency,
            turns=args.turns,
        )
        wall = time.perf_counter() - start
        env1, kids1 = _rusage()
        gw1, model1 = _cpu_s(procs["gateway"]), _cpu_s(procs["model"])
    return Sample(mode, turns, wall, env1 - env0, kids1 - kids0, gw1 - gw0, model1 - model0)


def _print(samples: list[Sample]) -> None:
    header = f"{'mode':8} {'turns':>6} {'wall s':>7} {'env ms/turn':>12} {'agents':>8} "
    header += f"{'gateway':>8} {'model':>7} {'total ms/turn':>14}"
    print(header)
    for s in samples:
        print(
            f"{s.mode:8} {s.turns:6d} {s.wall_s:7.2f} {s.per_turn_ms(s.env_s):12.2f} "
            f"{s.per_turn_ms(s.agents_s):8.2f} {s.per_turn_ms(s.gateway_s):8.2f} "
            f"{s.per_turn_ms(s.model_s):7.2f} {s.per_turn_ms(s.total_s):14.2f}"
        )
    by_mode: dict[str, list[Sample]] = {}
    for s in samples:
        by_mode.setdefault(s.mode, []).append(s)

    def mean(mode: str, what: str) -> float:
        runs = by_mode[mode]
        return sum(s.per_turn_ms(getattr(s, what)) for s in runs) / len(runs)

    env_ratio = mean("gateway", "env_s") / mean("v1", "env_s")
    total_ratio = mean("gateway", "total_s") / mean("v1", "total_s")
    print(f"env-process CPU per turn, gateway / v1: {env_ratio:.2f}")
    print(f"total CPU per turn, gateway / v1:       {total_ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2, help="alternating runs per mode")
    parser.add_argument("--turns", type=int, default=0, help="turns of a synthetic task")
    args = parser.parse_args()
    os.environ["ROLLOUT_GATEWAY_ADMIN_TOKEN"] = ADMIN_TOKEN  # the gateway process reads it
    model_port, gateway_port = _free_port(), _free_port()
    model_url = f"http://127.0.0.1:{model_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    with (
        _cli(["scripted-model", "--port", str(model_port)], f"{model_url}/v1/models") as mp,
        _cli(
            ["serve", "--upstream", f"{model_url}/v1", "--port", str(gateway_port)],
            f"{gateway_url}/health",
        ) as gp,
    ):
        procs = {"model": mp, "gateway": gp, "model_url": model_url, "gateway_url": gateway_url}
        samples = []
        for _ in range(args.repeat):
            for mode in ("v1", "gateway"):
                samples.append(asyncio.run(_measure(mode, args, procs)))
    _print(samples)


if __name__ == "__main__":
    main()
