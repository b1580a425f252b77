"""Added latency and throughput cost of the rollout gateway, plus token storage density.

Starts the scripted model (zero latency) and the gateway in two separate processes on
loopback (through the ``rollout-gateway`` CLI), then runs the same multi-turn load from this
process with httpx: (a) straight to the model, (b) through the gateway (register, turns,
trajectory, unregister). Every request asks for token ids and logprobs in both runs, so the
model does the same work and the difference is the gateway's (proxy hop + recording).

    python benchmarks/gateway_overhead.py [--rollouts 64] [--turns 20] [--tool-output-chars 400]

Finally it records a 128k-token trajectory in-process and reports the bytes the recorder
holds per token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from rollout_gateway.server.recorder import TrajectoryRecorder


def _cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _process(args: list[str], health_url: str) -> Iterator[subprocess.Popen[bytes]]:
    cmd = [sys.executable, "-m", "rollout_gateway.cli", *args, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {proc.returncode}")
            try:
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args[0]} did not start")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass
class RunResult:
    latencies_s: list[float]
    wall_s: float
    cpu_after_turns: float = 0.0

    @property
    def turns_per_s(self) -> float:
        return len(self.latencies_s) / self.wall_s

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _script(turns: int) -> str:
    steps = [{"tool": "run", "arguments": {"cmd": f"step {i}"}} for i in range(turns - 1)]
    steps.append({"say": "finished"})
    return f"Benchmark task. <script>{json.dumps(steps)}</script>"


async def _rollout(
    client: httpx.AsyncClient, url: str, turns: int, tool_chars: int, lat: list[float]
) -> None:
    messages: list[dict] = [
        {"role": "system", "content": "You are a CLI agent."},
        {"role": "user", "content": _script(turns)},
    ]
    for turn in range(turns):
        body = {
            "model": "scripted",
            "messages": messages,
            "return_token_ids": True,
            "logprobs": True,
        }
        start = time.perf_counter()
        r = await client.post(url, json=body)
        lat.append(time.perf_counter() - start)
        r.raise_for_status()
        message = r.json()["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or ():
            output = (f"output of turn {turn} " * (tool_chars // 16 + 1))[:tool_chars]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})


async def _run(
    base: str,
    *,
    gateway: bool,
    rollouts: int,
    turns: int,
    tool_chars: int,
    cpu_probe: Callable[[], float] = lambda: 0.0,
) -> RunResult:
    ids = [f"bench_{os.getpid()}_{gateway}_{i}" for i in range(rollouts)]
    async with contextlib.AsyncExitStack() as stack:
        control = await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=60))
        # One client per rollout, like one agent process each (and httpcore's pool gets
        # slow with many connections in a single client, which would skew the baseline).
        agents = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=60))
            for _ in ids
        ]
        if gateway:
            for rid in ids:
                reg = {"model": "scripted", "sampling_params": {"temperature": 0}, "max_turns": -1}
                (await control.post(f"/v1/rollouts/{rid}/register", json=reg)).raise_for_status()
        latencies: list[float] = []
        urls = [
            f"/v1/rollouts/{rid}/chat/completions" if gateway else "/v1/chat/completions"
            for rid in ids
        ]
        start = time.perf_counter()
        await asyncio.gather(
            *(
                _rollout(c, u, turns, tool_chars, latencies)
                for c, u in zip(agents, urls, strict=True)
            )
        )
        wall = time.perf_counter() - start
        cpu_after_turns = cpu_probe()
        if gateway:
            for rid in ids:
                traj = (await control.get(f"/v1/rollouts/{rid}/trajectory")).json()
                assert traj["num_turns"] == turns, traj["num_turns"]
                assert all(s["tokens"] is not None for s in traj["trajectory"])
                await control.post(f"/v1/rollouts/{rid}/unregister")
        return RunResult(latencies, wall, cpu_after_turns)


async def _warmup(base: str, gateway: bool) -> None:
    await _run(base, gateway=gateway, rollouts=4, turns=3, tool_chars=50)


def storage_per_token(target_tokens: int = 128 * 1024) -> tuple[int, int, int]:
    """Record a ``target_tokens``-token trajectory; (bytes, unique tokens, logical tokens)."""
    rec = TrajectoryRecorder("bench", max_seq_len=None)
    context: list[int] = list(range(1000))  # system + task prompt
    messages: list[dict] = [{"role": "user", "content": "task"}]
    turn = 0
    while len(context) < target_tokens:
        completion = [(turn * 7 + i) % 50_000 for i in range(300)]
        rec.record(
            messages,
            [{"role": "assistant", "content": f"turn {turn}"}],
            prompt_ids=context,
            completion_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            finish_reason="stop",
        )
        tool_output = [(turn * 13 + i) % 50_000 for i in range(1700)]
        context = [*context, *completion, *tool_output]
        messages = [*messages, {"role": "assistant", "content": f"turn {turn}"}]
        messages.append({"role": "tool", "content": "output"})
        turn += 1
    unique = len(context) - 1700  # the last tool output was never sent
    return rec.token_storage_bytes(), unique, rec.logical_token_count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=64, help="concurrent rollouts")
    parser.add_argument("--turns", type=int, default=20, help="turns per rollout")
    parser.add_argument("--tool-output-chars", type=int, default=400)
    args = parser.parse_args()

    model_port, gateway_port = _free_port(), _free_port()
    model_root = f"http://127.0.0.1:{model_port}"
    gateway_root = f"http://127.0.0.1:{gateway_port}"
    with (
        _process(["scripted-model", "--port", str(model_port)], f"{model_root}/v1/models") as mp,
        _process(
            [
                "serve",
                "--upstream",
                f"{model_root}/v1",
                "--port",
                str(gateway_port),
                "--max-rollouts",
                str(max(10_000, args.rollouts * 4)),
            ],
            f"{gateway_root}/health",
        ) as gp,
    ):
        kw = {"rollouts": args.rollouts, "turns": args.turns, "tool_chars": args.tool_output_chars}
        asyncio.run(_warmup(model_root, False))
        asyncio.run(_warmup(gateway_root, True))
        cpu0 = (_cpu_s(mp.pid), _cpu_s(gp.pid))
        direct = asyncio.run(_run(model_root, gateway=False, **kw))
        cpu1 = (_cpu_s(mp.pid), _cpu_s(gp.pid))
        via = asyncio.run(_run(gateway_root, gateway=True, cpu_probe=lambda: _cpu_s(gp.pid), **kw))
        cpu2 = (_cpu_s(mp.pid), _cpu_s(gp.pid))

    n = args.rollouts * args.turns
    print(f"load: {args.rollouts} concurrent rollouts x {args.turns} turns = {n} turns per run")
    print(f"{'':24}{'p50 ms':>10}{'p99 ms':>10}{'turns/s':>10}")
    for name, res in (("direct to model", direct), ("through gateway", via)):
        print(f"{name:24}{res.pct(0.5):10.2f}{res.pct(0.99):10.2f}{res.turns_per_s:10.1f}")
    print(
        f"{'added by gateway':24}{via.pct(0.5) - direct.pct(0.5):10.2f}"
        f"{via.pct(0.99) - direct.pct(0.99):10.2f}"
        f"{'':>4}ratio {via.turns_per_s / direct.turns_per_s:.2f}"
    )
    print(
        f"mean latency ms: direct {statistics.mean(direct.latencies_s) * 1000:.2f}, "
        f"gateway {statistics.mean(via.latencies_s) * 1000:.2f}"
    )

    per_turn = 1000 / n
    gw_turns = (via.cpu_after_turns - cpu1[1]) * per_turn
    gw_total = (cpu2[1] - cpu1[1]) * per_turn
    print(
        f"CPU ms per turn: model {(cpu1[0] - cpu0[0]) * per_turn:.2f} (direct run), "
        f"{(cpu2[0] - cpu1[0]) * per_turn:.2f} (gateway run); gateway {gw_turns:.2f} for the "
        f"turns, {gw_total:.2f} with register + trajectory fetch + unregister"
    )
    print(f"host load average after the runs: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")

    stored, unique, logical = storage_per_token()
    print(
        f"token storage, {unique}-token trajectory ({logical} tokens over its steps): "
        f"{stored} bytes = {stored / unique:.2f} bytes/unique token, "
        f"{stored / logical:.3f} bytes/reported token"
    )


if __name__ == "__main__":
    main()
