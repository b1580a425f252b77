"""CPU per turn on verifiers v1: v1's own interception vs gateway mode, same v1 agent.

Runs the ``fix-bug-v1`` example's agent (a real subprocess on v1's subprocess runtime)
from this process, the *env process*, side by side in one run:

- ``v1``: v1's own ``InterceptionServer`` in the env process relays every model call to
  the scripted model (and commits it into the trace);
- ``gateway``: :class:`rollout_gateway.v1.GatewayInterception`; the agents call the
  reference gateway (its own process) directly, the env registers, replays the recorded
  turns into the trace at the harness's exit, and unregisters.

The scripted model and the gateway run as separate processes (``rollout-gateway`` CLI).
Each task is N tool-calling turns on a prompt padded to the context size (the scripted
model's tokens are bytes). The figure is the *marginal* CPU of a turn: each mode runs
the same rollouts with ``--turns-short`` and with ``--turns-long`` turns, and the
difference in CPU divided by the difference in turns removes what a rollout costs once
(v1's agent machinery, spawning the agent, register/unregister/fetch), which both modes
pay per rollout, not per turn. Reported per context and mode, per turn: env-process CPU
(``getrusage(SELF)``), agent CPU (the agent programs, ``getrusage(CHILDREN)``), gateway
and model process CPU (``/proc``), and the gateway / v1 ratios. Modes alternate, round by
round, so both see the same machine.

    python benchmarks/v1_interception_cpu.py               # 1k and 32k contexts
    python benchmarks/v1_interception_cpu.py --quick       # the same, smaller (< 3 min)
    python benchmarks/v1_interception_cpu.py --contexts 1024,32768 --rollouts 8 \\
        --concurrency 4 --repeat 3 --turns-short 2 --turns-long 12

Needs ``rollout-gateway[v1]`` and ``examples/fix_bug_v1`` installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarnessConfig, FixBugTask
from fix_bug_v1.tasks import FixBugData, task_prompt
from gateway_overhead import _free_port, _proc_stat, _process
from verifiers.v1.interception import InterceptionServer

from rollout_gateway.v1 import (
    GatewayInterception,
    GatewayInterceptionConfig,
    gateway_synced_agent,
)

ADMIN_TOKEN = "benchmark-admin-token-0123456789"
MODES = ("v1", "gateway")


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process (gateway_overhead's per-process clock)."""
    return _proc_stat(pid)[0]


def _cli(args: list[str], health_url: str) -> contextlib.AbstractContextManager[int]:
    """A ``rollout-gateway`` subcommand as its own process, ready; yields its pid."""
    cmd = [sys.executable, "-m", "rollout_gateway.cli", *args, "--log-level", "warning"]
    return _process(cmd, health_url)


@dataclass
class Sample:
    """CPU seconds and turns of one measured batch of rollouts."""

    turns: int
    wall_s: float
    env_s: float
    agents_s: float
    gateway_s: float
    model_s: float

    def __sub__(self, other: Sample) -> Sample:
        return Sample(
            self.turns - other.turns,
            self.wall_s - other.wall_s,
            self.env_s - other.env_s,
            self.agents_s - other.agents_s,
            self.gateway_s - other.gateway_s,
            self.model_s - other.model_s,
        )

    def per_turn_ms(self, what: str) -> float:
        return 1000 * getattr(self, what) / max(1, self.turns)


def _rusage() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _task(turns: int, context: int) -> Any:
    """One task of ``turns`` turns (``turns - 1`` cheap shell calls, then an answer) whose
    prompt is padded to about ``context`` tokens of the scripted model (bytes)."""
    steps: list[Any] = [
        {"tool": "run_shell", "arguments": {"command": f"echo step {i}"}} for i in range(turns - 1)
    ]
    steps.append({"say": "done"})
    head = task_prompt("Benchmark task.", steps)
    padding = max(0, context - len(head) - 600)  # the agent's system prompt and tools
    filler = ("context " * (padding // 8 + 1))[:padding]
    data = FixBugData(
        id=f"t{turns}-c{context}",
        prompt=task_prompt(f"Benchmark task. {filler}", steps),
        files={},
        test_command="true",
    )
    return FixBugTask(data)


async def _rollouts(
    interception: Any, base_url: str, *, sync: bool, task: Any, rollouts: int, concurrency: int
) -> int:
    config = vf.AgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=base_url),
        harness=FixBugHarnessConfig(max_agent_turns=64),
        runtime=vf.SubprocessConfig(),
    )
    gate = asyncio.Semaphore(concurrency)
    agent = vf.Agent(config, interception=interception)
    if sync:
        gateway_synced_agent(agent, interception)

    async def one() -> int:
        async with gate:
            trace = await agent.run(task)
        if not trace.ok:
            raise RuntimeError(f"rollout failed: {trace.errors}")
        return trace.num_turns

    async with agent:
        return sum(await asyncio.gather(*(one() for _ in range(rollouts))))


@contextlib.asynccontextmanager
async def _interception(mode: str) -> Any:
    if mode == "v1":
        interception: Any = InterceptionServer(requires_tunnel=False)
    else:
        interception = GatewayInterception(
            GatewayInterceptionConfig(tunnel="direct"), admin_token=ADMIN_TOKEN
        )
    async with interception:
        yield interception


async def _measure(
    mode: str, task: Any, args: argparse.Namespace, procs: dict[str, Any], interception: Any
) -> Sample:
    url = procs["model_url"] if mode == "v1" else procs["gateway_url"]
    base_url, sync = f"{url}/v1", mode == "gateway"
    env0, kids0 = _rusage()
    gw0, model0 = _cpu_s(procs["gateway"]), _cpu_s(procs["model"])
    start = time.perf_counter()
    turns = await _rollouts(
        interception,
        base_url,
        sync=sync,
        task=task,
        rollouts=args.rollouts,
        concurrency=args.concurrency,
    )
    wall = time.perf_counter() - start
    env1, kids1 = _rusage()
    gw1, model1 = _cpu_s(procs["gateway"]), _cpu_s(procs["model"])
    return Sample(turns, wall, env1 - env0, kids1 - kids0, gw1 - gw0, model1 - model0)


async def _run(
    args: argparse.Namespace, procs: dict[str, Any]
) -> dict[tuple[int, str], list[Sample]]:
    """Marginal samples by (context, mode): long minus short, round by round."""
    marginal: dict[tuple[int, str], list[Sample]] = {}
    for context in args.contexts:
        short = _task(args.turns_short, context)
        long = _task(args.turns_long, context)
        for mode in MODES:  # warm-up: imports, connections, first-call paths
            async with _interception(mode) as interception:
                await _measure(mode, short, _warmup(args), procs, interception)
        for _ in range(args.repeat):
            for mode in MODES:
                async with _interception(mode) as interception:
                    a = await _measure(mode, short, args, procs, interception)
                    b = await _measure(mode, long, args, procs, interception)
                marginal.setdefault((context, mode), []).append(b - a)
    return marginal


def _warmup(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "rollouts": 2, "concurrency": 2})


def _print(marginal: dict[tuple[int, str], list[Sample]], args: argparse.Namespace) -> None:
    print(
        f"marginal CPU per turn ({args.turns_long} - {args.turns_short} turns, "
        f"{args.rollouts} rollouts x {args.repeat} rounds, concurrency {args.concurrency}); "
        "medians over the rounds, each round's env figure in parentheses:"
    )
    print(
        f"{'context':>8} {'mode':8} {'env ms/turn':>12} {'(rounds)':>24} {'agents':>8} "
        f"{'gateway':>8} {'model':>7} {'total':>7}"
    )

    def mean(samples: list[Sample], what: str) -> float:
        return statistics.fmean(s.per_turn_ms(what) for s in samples)

    def median(samples: list[Sample], what: str) -> float:
        return statistics.median(s.per_turn_ms(what) for s in samples)

    for context in args.contexts:
        for mode in MODES:
            runs = marginal[(context, mode)]
            rounds = ",".join(f"{s.per_turn_ms('env_s'):.2f}" for s in runs)
            total = sum(median(runs, w) for w in ("env_s", "agents_s", "gateway_s", "model_s"))
            print(
                f"{context:8d} {mode:8} {median(runs, 'env_s'):12.3f} {rounds:>24} "
                f"{median(runs, 'agents_s'):8.2f} {median(runs, 'gateway_s'):8.2f} "
                f"{median(runs, 'model_s'):7.2f} {total:7.2f}"
            )
    for context in args.contexts:
        v1, gateway = marginal[(context, "v1")], marginal[(context, "gateway")]
        ratio = median(gateway, "env_s") / median(v1, "env_s")
        of_means = mean(gateway, "env_s") / mean(v1, "env_s")
        per_round = [
            g.per_turn_ms("env_s") / v.per_turn_ms("env_s")
            for g, v in zip(gateway, v1, strict=True)
        ]
        print(
            f"context {context}: env-process CPU per turn, gateway / v1 = {ratio:.2f} "
            f"(of the medians; of the means {of_means:.2f}; each round: "
            f"{', '.join(f'{r:.2f}' for r in per_round)})"
        )


def _contexts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--contexts",
        type=_contexts,
        default=[1024, 32768],
        help="context sizes in tokens, comma-separated (default 1024,32768)",
    )
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per measurement")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds per mode")
    parser.add_argument("--turns-short", type=int, default=2)
    parser.add_argument("--turns-long", type=int, default=12)
    parser.add_argument(
        "--turns", type=int, default=None, help="alias of --turns-long (the earlier option)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 rollouts, 1 round, 2 vs 8 turns: the same figures, noisier",
    )
    args = parser.parse_args()  # fmt: skip
    if args.turns is not None:
        args.turns_long = args.turns
    if args.quick:
        args.rollouts, args.repeat, args.turns_short, args.turns_long = 4, 1, 2, 8
    if args.turns_long <= args.turns_short:
        parser.error("--turns-long must be above --turns-short")
    os.environ["ROLLOUT_GATEWAY_ADMIN_TOKEN"] = ADMIN_TOKEN  # the gateway process reads it
    model_port, gateway_port = _free_port(), _free_port()
    model_url = f"http://127.0.0.1:{model_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    started = time.perf_counter()
    with (
        _cli(["scripted-model", "--port", str(model_port)], f"{model_url}/v1/models") as mp,
        _cli(
            ["serve", "--upstream", f"{model_url}/v1", "--port", str(gateway_port)],
            f"{gateway_url}/health",
        ) as gp,
    ):
        procs = {"model": mp, "gateway": gp, "model_url": model_url, "gateway_url": gateway_url}
        marginal = asyncio.run(_run(args, procs))
    _print(marginal, args)
    print(f"({os.cpu_count()} CPUs; ran {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
