"""Burst benchmark: N concurrent gateway rollouts on one env, as a trainer at a step boundary.

Every rollout goes through the real mixin code path (``env.run_rollout``: register,
tunnel, sandbox, agent, poll, trajectory fetch, scoring, cleanup) against the in-memory
fakes of :mod:`rollout_gateway.testing`, with realistic latencies:

- control plane (FakeGateway): 2-10 ms per call;
- sandbox create 100-500 ms, ready 0-50 ms;
- agent: 2-5 turns recorded through ``gateway.add_turn`` with token ids (prompts of a
  few hundred tokens, growing each turn), 0.5-2 s of work in total;
- tunnel start: ~1 s (FakeTunnelProvider).

The poll policy is the library's default :class:`PollPolicy` (that is what is measured).

Usage::

    python benchmarks/burst.py [--rollouts 500] [--hosts 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import verifiers as vf
from datasets import Dataset
from openai import AsyncOpenAI

from rollout_gateway import RolloutGatewayMixin
from rollout_gateway.testing import (
    FakeGateway,
    FakeSandbox,
    FakeSandboxClient,
    FakeTunnelProvider,
    rollout_id_of,
    task_row,
)

# Latencies (seconds).
GATEWAY_LATENCY = (0.002, 0.010)
CREATE_LATENCY = (0.100, 0.500)
READY_LATENCY = (0.0, 0.050)
AGENT_WORK = (0.5, 2.0)
AGENT_TURNS = (2, 5)
TUNNEL_START_LATENCY = 1.0

# Targets.
WALL_RATIO_TARGET = 1.10
DETECT_P50_TARGET_MS = 100.0
DETECT_P99_TARGET_MS = 300.0
RSS_TARGET_MB_PER_500 = 300.0

VOCAB = 150_000


@dataclass
class Work:
    """The simulated work of one rollout, as drawn (seconds) and observed."""

    create: float = 0.0
    ready: float = 0.0
    agent: float = 0.0
    turns: int = 0
    agent_exit_wall: float | None = None  # time.time() when the agent coroutine returned

    @property
    def total(self) -> float:
        return self.create + self.ready + self.agent


def dataset(n: int) -> Dataset:
    return Dataset.from_list([task_row(i) for i in range(n)])


class BurstEnv(RolloutGatewayMixin, vf.CliAgentEnv):
    """A gateway env as an author writes it; the reward is 1 when the agent made turns."""

    use_gateway = True

    def __init__(self, **kwargs: Any) -> None:
        async def made_turns(state: vf.State) -> float:
            return 1.0 if state.get("trajectory") else 0.0

        super().__init__(
            run_command="python agent.py",
            dataset=dataset(4),
            rubric=vf.Rubric(funcs=[made_turns]),
            **kwargs,
        )


class BenchSandboxClient(FakeSandboxClient):
    """FakeSandboxClient whose create/ready latencies are drawn per rollout and recorded."""

    def __init__(self, agent: Any, rng: random.Random, work: dict[str, Work]) -> None:
        super().__init__(agent)
        self.rng = rng
        self.work = work

    async def create(self, request: Any) -> Any:
        seconds = self.rng.uniform(*CREATE_LATENCY)
        self.work.setdefault(request.name, Work()).create = seconds
        await asyncio.sleep(seconds)
        return await super().create(request)

    async def wait_for_creation(self, sandbox_id: str, **kwargs: Any) -> None:
        seconds = self.rng.uniform(*READY_LATENCY)
        rollout_id = self.sandboxes[sandbox_id].request.name
        self.work.setdefault(rollout_id, Work()).ready = seconds
        await asyncio.sleep(seconds)
        await super().wait_for_creation(sandbox_id, **kwargs)


class TokenPool:
    """Random token ids and logprobs drawn once, sliced per turn.

    A real agent runs in its sandbox and the gateway produces the token ids; drawing
    millions of ids on the env's event loop would measure the benchmark, not the mixin.
    """

    def __init__(self, rng: random.Random, size: int = 1 << 16) -> None:
        self.rng = rng
        self.ids = [rng.randrange(VOCAB) for _ in range(size)]
        self.logprobs = [-rng.random() for _ in range(size)]

    def _slice(self, values: list[Any], n: int) -> list[Any]:
        start = self.rng.randrange(len(values) - n)
        return values[start : start + n]

    def record(self, prompt_len: int, completion_len: int) -> dict[str, Any]:
        """A step token record as the gateway sends it."""
        return {
            "prompt_ids": self._slice(self.ids, prompt_len),
            "prompt_mask": [0] * prompt_len,
            "completion_ids": self._slice(self.ids, completion_len),
            "completion_mask": [1] * completion_len,
            "completion_logprobs": self._slice(self.logprobs, completion_len),
            "overlong_prompt": False,
            "is_truncated": False,
        }


def make_agent(gateway: FakeGateway, rng: random.Random, work: dict[str, Work]) -> Any:
    """The agent process: a multi-turn tool-using loop recorded by the gateway."""
    pool = TokenPool(rng)

    async def agent(sandbox: FakeSandbox) -> int:
        rid = rollout_id_of(sandbox)
        record = work.setdefault(rid, Work())
        turns = rng.randint(*AGENT_TURNS)
        total = rng.uniform(*AGENT_WORK)
        # Split the work between the turns (model call + tool execution).
        cuts = sorted(rng.random() for _ in range(turns - 1))
        shares = [b - a for a, b in zip([0.0, *cuts], [*cuts, 1.0], strict=True)]
        record.agent, record.turns = total, turns
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the failing test."},
        ]
        prompt_len = rng.randint(200, 600)
        for turn, share in enumerate(shares):
            await asyncio.sleep(total * share)
            completion_len = rng.randint(30, 200)
            last = turn == turns - 1
            if last:
                reply: dict[str, Any] = {"role": "assistant", "content": "Done."}
            else:
                reply = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"c{turn}",
                            "type": "function",
                            "function": {
                                "name": "run_shell",
                                "arguments": '{"command": "pytest -x"}',
                            },
                        }
                    ],
                }
            gateway.add_turn(
                rid,
                list(messages),
                [reply],
                tokens=pool.record(prompt_len, completion_len),
            )
            tool_len = rng.randint(50, 300)
            messages += [reply, {"role": "tool", "tool_call_id": f"c{turn}", "content": "ok"}]
            prompt_len += completion_len + tool_len
        record.agent_exit_wall = time.time()
        return 0

    return agent


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1), nearest-rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


async def monitor_loop_lag(lags_ms: list[float], period: float = 0.01) -> None:
    """Sample how late the event loop wakes a ``period`` sleep (loop saturation)."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(period)
        lags_ms.append((time.monotonic() - t0 - period) * 1000)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


async def bench(rollouts: int, hosts: int, seed: int) -> bool:
    rng = random.Random(seed)
    work: dict[str, Work] = {}
    gateway = FakeGateway(latency=lambda: rng.uniform(*GATEWAY_LATENCY))
    sandboxes = BenchSandboxClient(make_agent(gateway, rng, work), rng, work)
    sandboxes.on_agent_exit = gateway.agent_exited  # the launch wrapper's exit report
    tunnels = FakeTunnelProvider(start_latency=TUNNEL_START_LATENCY)
    env = BurstEnv(
        sandbox_client=sandboxes,
        gateway={"tunnel_provider": tunnels, "transport": gateway.transport()},
        sandbox_creations_per_minute=None,
    )  # default PollPolicy and RetryPolicy
    clients = [
        vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=f"http://gateway-{h}.test:8000/v1", api_key="x")
        )
        for h in range(hosts)
    ]
    rss_before = peak_rss_mb()

    async def one(i: int) -> tuple[Any, float]:
        row = task_row(i)
        t0 = time.time()
        output = await env.run_rollout(
            row,
            clients[i % hosts],
            "policy-model",
            {"temperature": 1.0, "max_tokens": 512},
            state_columns=["rollout_id", "agent_end_time", "agent_polls"],
        )
        return output, time.time() - t0

    async def burst(label: str, offset: int) -> dict[str, Any]:
        work.clear()
        lags_ms: list[float] = []
        monitor = asyncio.ensure_future(monitor_loop_lag(lags_ms))
        start, cpu_start = time.time(), time.process_time()
        results = await asyncio.gather(*(one(offset + i) for i in range(rollouts)))
        wall, cpu = time.time() - start, time.process_time() - cpu_start
        monitor.cancel()
        outputs = [o for o, _ in results]
        overhead_ms: list[float] = []
        detect_ms: list[float] = []
        polls: list[int] = []
        for o, duration in results:
            w = work[o["rollout_id"]]
            polls.append(o["agent_polls"])
            if w.agent_exit_wall is not None and o.get("agent_end_time") is not None:
                detect_ms.append((o["agent_end_time"] - w.agent_exit_wall) * 1000)
            overhead_ms.append((duration - w.total) * 1000)
        slowest = max(w.total for w in work.values())
        print(f"--- {label}")
        print(f"wall time:                   {wall:.3f} s")
        print(f"slowest rollout's own work:  {slowest:.3f} s (create + ready + agent)")
        print(f"wall / slowest:              {wall / slowest:.3f}")
        print(
            f"orchestration overhead:      p50 {pct(overhead_ms, 0.5):.1f} ms, "
            f"p99 {pct(overhead_ms, 0.99):.1f} ms, max {max(overhead_ms):.1f} ms per rollout"
        )
        print(
            f"completion-detection delay:  p50 {pct(detect_ms, 0.5):.1f} ms, "
            f"p99 {pct(detect_ms, 0.99):.1f} ms, max {max(detect_ms):.1f} ms"
        )
        print(f"poll calls per rollout:      mean {statistics.mean(polls):.2f}, max {max(polls)}")
        print(
            f"event-loop lag (10 ms tick): p50 {pct(lags_ms, 0.5):.1f} ms, "
            f"p99 {pct(lags_ms, 0.99):.1f} ms, max {max(lags_ms):.1f} ms; "
            f"process CPU during burst {cpu:.2f} s ({cpu / rollouts * 1000:.1f} ms/rollout)"
        )
        return {
            "ratio": wall / slowest,
            "detect_p50": pct(detect_ms, 0.5),
            "detect_p99": pct(detect_ms, 0.99),
            "errors": [o for o in outputs if o.get("error") is not None],
        }

    print(f"rollouts:                    {rollouts} per burst over {hosts} host(s), seed {seed}")
    try:
        # First step of a training run: every rollout also waits for the tunnel start.
        cold = await burst("cold burst (first step: tunnels start)", 0)
        # Every later step: the shared tunnels are up.
        warm = await burst("warm burst (later steps: tunnels shared)", rollouts)
        leftover_rollouts = gateway.active
        leftover_sandboxes = sandboxes.alive
    finally:
        await env._teardown()
    tunnels_stopped = all(not h.alive for h in tunnels.handles)
    errors = cold["errors"] + warm["errors"]
    rss = peak_rss_mb()
    rss_target = RSS_TARGET_MB_PER_500 * max(1.0, rollouts / 500)
    print("---")
    print(f"errors:                      {len(errors)}")
    print(f"tunnel starts:               {len(tunnels.opened)} (hosts: {hosts})")
    print(
        f"peak RSS:                    {rss:.1f} MB (after imports, before the bursts: "
        f"{rss_before:.1f} MB; growth {rss - rss_before:.1f} MB)"
    )
    print(
        f"gateway rollouts left:       {len(leftover_rollouts)}, "
        f"sandboxes left: {len(leftover_sandboxes)}, tunnels stopped: {tunnels_stopped}"
    )
    checks = {
        f"warm wall within {WALL_RATIO_TARGET - 1:.0%} of slowest rollout": warm["ratio"]
        <= WALL_RATIO_TARGET,
        f"tunnel starts == hosts ({hosts})": len(tunnels.opened) == hosts,
        f"warm detection p50 < {DETECT_P50_TARGET_MS:.0f} ms": warm["detect_p50"]
        < DETECT_P50_TARGET_MS,
        f"warm detection p99 < {DETECT_P99_TARGET_MS:.0f} ms": warm["detect_p99"]
        < DETECT_P99_TARGET_MS,
        f"peak RSS < {rss_target:.0f} MB": rss < rss_target,
        "no errors": not errors,
        "gateway and sandboxes empty": not leftover_rollouts and not leftover_sandboxes,
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
