"""Burst benchmark: N concurrent gateway rollouts on one env, as a trainer at a step boundary.

Every rollout goes through the real mixin code path (``env.run_rollout``: register,
tunnel, sandbox, agent, poll, trajectory fetch, scoring, cleanup) against the seeded
fake world of ``benchmarks/burst_world.py`` (the one ``burst_compare.py`` runs both
mixins on), with realistic latencies:

- control plane (fake gateway): 2-10 ms per call; sandbox API calls 5-20 ms;
- sandbox create 100-500 ms, ready 0-50 ms;
- agent: 2-5 turns recorded through ``gateway.add_turn`` with token ids (prompts of a
  few hundred tokens, growing each turn), 0.5-2 s of work in total;
- tunnel start: 1 s.

The env is built by ``burst_compare.build_ours`` with the library's default settings
(poll and retry policies): that is what is measured.

Usage::

    python benchmarks/burst.py [--rollouts 500] [--hosts 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import verifiers as vf
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import burst_world as bw  # noqa: E402
from burst_compare import build_ours  # noqa: E402
from burst_world import pct  # noqa: E402

from rollout_gateway.testing import task_row  # noqa: E402

# Targets.
WALL_RATIO_TARGET = 1.10
DETECT_P50_TARGET_MS = 100.0
DETECT_P99_TARGET_MS = 300.0
RSS_TARGET_MB_PER_500 = 300.0


async def monitor_loop_lag(lags_ms: list[float], period: float = 0.01) -> None:
    """Sample how late the event loop wakes a ``period`` sleep (loop saturation)."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(period)
        lags_ms.append((time.monotonic() - t0 - period) * 1000)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@dataclass
class BurstFigures:
    """What one burst measured."""

    wall: float
    cpu: float
    slowest: float
    overhead_ms: list[float]
    detect_ms: list[float]
    polls: list[int]
    lags_ms: list[float]
    errors: list[Any]

    @property
    def ratio(self) -> float:
        """The burst's wall time over its slowest rollout's own work."""
        return self.wall / self.slowest

    def show(self, label: str, rollouts: int) -> None:
        """Print the burst's figures under ``label``."""
        overhead, detect, lags = self.overhead_ms, self.detect_ms, self.lags_ms
        print(f"--- {label}")
        print(f"wall time:                   {self.wall:.3f} s")
        print(f"slowest rollout's own work:  {self.slowest:.3f} s (create + ready + agent)")
        print(f"wall / slowest:              {self.ratio:.3f}")
        print(
            f"orchestration overhead:      p50 {pct(overhead, 0.5):.1f} ms, "
            f"p99 {pct(overhead, 0.99):.1f} ms, max {max(overhead):.1f} ms per rollout"
        )
        print(
            f"completion-detection delay:  p50 {pct(detect, 0.5):.1f} ms, "
            f"p99 {pct(detect, 0.99):.1f} ms, max {max(detect, default=0):.1f} ms"
        )
        polls = self.polls
        print(f"poll calls per rollout:      mean {statistics.mean(polls):.2f}, max {max(polls)}")
        print(
            f"event-loop lag (10 ms tick): p50 {pct(lags, 0.5):.1f} ms, "
            f"p99 {pct(lags, 0.99):.1f} ms, max {max(lags):.1f} ms; process CPU during "
            f"burst {self.cpu:.2f} s ({self.cpu / rollouts * 1000:.1f} ms/rollout)"
        )


async def run_burst(
    env: Any,
    world: bw.World,
    one: Callable[[int], Awaitable[tuple[Any, float]]],
    rollouts: int,
    offset: int,
) -> BurstFigures:
    """``rollouts`` concurrent rollouts (``one``) on tasks ``offset..``, measured."""
    env.probe.clear()
    lags_ms: list[float] = []
    monitor = asyncio.ensure_future(monitor_loop_lag(lags_ms))
    start, cpu_start = time.time(), time.process_time()
    results = await asyncio.gather(*(one(offset + i) for i in range(rollouts)))
    wall, cpu = time.time() - start, time.process_time() - cpu_start
    monitor.cancel()
    overhead_ms: list[float] = []
    detect_ms: list[float] = []
    polls: list[int] = []
    for i, (o, duration) in enumerate(results):
        rid = o["rollout_id"]
        polls.append(o.get("agent_polls") or 0)
        if rid in world.agent_exit and rid in env.probe.detected:
            detect_ms.append((env.probe.detected[rid] - world.agent_exit[rid]) * 1000)
        overhead_ms.append((duration - world.plan(offset + i).total) * 1000)
    slowest = max(world.plan(offset + i).total for i in range(rollouts))
    errors = [o for o, _ in results if o.get("error") is not None]
    return BurstFigures(wall, cpu, slowest, overhead_ms, detect_ms, polls, lags_ms, errors)


async def bench(rollouts: int, hosts: int, seed: int) -> bool:
    """A cold and a warm burst; print the figures and the checks; whether all passed."""
    world = bw.World(seed)
    side = await build_ours(world)  # default poll and retry policies
    env, gateway, sandboxes = side.env, side.gateway, side.sandboxes
    env.probe = bw.Probe()
    clients = [
        vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=f"http://gateway-{h}.test:8000/v1", api_key="x")
        )
        for h in range(hosts)
    ]
    rss_before = peak_rss_mb()

    async def one(task_id: int) -> tuple[Any, float]:
        t0 = time.time()
        output = await env.run_rollout(
            task_row(task_id),
            clients[task_id % hosts],
            "policy-model",
            {"temperature": 1.0, "max_tokens": 512},
            state_columns=["rollout_id", "agent_polls"],
        )
        return output, time.time() - t0

    print(f"rollouts:                    {rollouts} per burst over {hosts} host(s), seed {seed}")
    try:
        # First step of a training run: every rollout also waits for the tunnel start.
        cold = await run_burst(env, world, one, rollouts, 0)
        cold.show("cold burst (first step: tunnels start)", rollouts)
        # Every later step: the shared tunnels are up.
        warm = await run_burst(env, world, one, rollouts, rollouts)
        warm.show("warm burst (later steps: tunnels shared)", rollouts)
        leftovers = (gateway.active, sandboxes.alive)
    finally:
        await env._teardown()
    return _report(side, (cold, warm), rollouts, hosts, rss_before, leftovers)


def _report(
    side: Any,
    bursts: tuple[BurstFigures, BurstFigures],
    rollouts: int,
    hosts: int,
    rss_before: float,
    leftovers: tuple[Any, Any],
) -> bool:
    """Print the whole run's figures and checks (``leftovers``: the gateway's rollouts
    and the live sandboxes after the bursts); whether every check passed."""
    cold, warm = bursts
    leftover_rollouts, leftover_sandboxes = leftovers
    tunnels_stopped = side.tunnels_alive() == 0
    tunnel_starts = side.tunnel_starts()
    errors = cold.errors + warm.errors
    rss = peak_rss_mb()
    print("---")
    print(f"errors:                      {len(errors)}")
    print(f"tunnel starts:               {tunnel_starts} (hosts: {hosts})")
    print(
        f"peak RSS:                    {rss:.1f} MB (after imports, before the bursts: "
        f"{rss_before:.1f} MB; growth {rss - rss_before:.1f} MB)"
    )
    print(
        f"gateway rollouts left:       {len(leftover_rollouts)}, "
        f"sandboxes left: {len(leftover_sandboxes)}, tunnels stopped: {tunnels_stopped}"
    )
    rss_target = RSS_TARGET_MB_PER_500 * max(1.0, rollouts / 500)
    checks = {
        f"warm wall within {WALL_RATIO_TARGET - 1:.0%} of slowest rollout": warm.ratio
        <= WALL_RATIO_TARGET,
        f"tunnel starts == hosts ({hosts})": tunnel_starts == hosts,
        f"warm detection p50 < {DETECT_P50_TARGET_MS:.0f} ms": pct(warm.detect_ms, 0.5)
        < DETECT_P50_TARGET_MS,
        f"warm detection p99 < {DETECT_P99_TARGET_MS:.0f} ms": pct(warm.detect_ms, 0.99)
        < DETECT_P99_TARGET_MS,
        f"peak RSS < {rss_target:.0f} MB": rss < rss_target,
        "no errors": not errors,
        "gateway and sandboxes empty": not leftover_rollouts and not leftover_sandboxes,
        "tunnels stopped at teardown": tunnels_stopped,
    }
    for name, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    for o in errors[:5]:
        print(f"  error: {o['error']}")
    assert not leftover_rollouts, f"gateway still holds {len(leftover_rollouts)} rollouts"
    assert not leftover_sandboxes, f"{len(leftover_sandboxes)} sandboxes still alive"
    assert not errors, f"{len(errors)} rollouts failed"
    return all(checks.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=500)
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rollouts < 1 or args.hosts < 1:
        parser.error("--rollouts and --hosts must be positive")
    logging.basicConfig(level=logging.WARNING)
    for name in ("verifiers", "rollout_gateway"):
        logging.getLogger(name).setLevel(logging.WARNING)
    ok = asyncio.run(bench(args.rollouts, args.hosts, args.seed))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
