"""Side by side: this project's mixin vs the earlier experimental mixin (verifiers 0.1.11).

One run measures both on the SAME seeded fake world (``benchmarks/burst_world.py``:
sandbox create/ready/agent times per task, control-plane and sandbox-API latencies,
1 s tunnel starts) at N concurrent rollouts, through each side's real code path
(``env.run_rollout``: register, tunnel, sandbox, agent, completion wait, trajectory
fetch, scoring, cleanup). The two need different verifiers (0.3 vs 0.1.11), so each
side runs in its own process and virtualenv, alternating A B A B with the same seed; the
parent collects each child's JSON and prints the table ``metric | ours | earlier |
ours/earlier`` (medians over the rounds) and PASS/FAIL lines for issue #8's targets.

Each child runs a warm-up burst of 4 rollouts (the tunnel starts, lazy imports and
first-use caches fill), then two bursts of N: "fresh" (the heap has not held N rollouts
yet) and "steady" (a later training step). Figures are the steady burst's, except RSS
per held rollout, which is given for both (the fresh one is what N rollouts cost).

- completion detected: ``wait_for_agent_completion`` returned, minus the moment the
  fake agent returned; for ours, split at the moment the env's exit watcher read the
  report off the exit stream (the stream's delivery, then the rollout's own part: its
  task waking, the one confirming status call, returning);
- job-status calls: ``get_background_job`` calls at the fake sandbox client / rollouts;
- env CPU: process CPU during the burst / rollouts (the fake world runs in the same
  process and does the same work on both sides, per call made to it);
- the verifiers floor: the same process then runs N concurrent do-nothing rollouts on
  its side's plain ``CliAgentEnv`` (state init, scoring, cleanup handlers, output; see
  :func:`floor_env`); "the mixin's own" CPU is env CPU minus that floor. The sides run
  different verifiers (0.3 vs 0.1.11), whose own per-rollout cost differs;
- GC: every collection timed through ``gc.callbacks``;
- register p50: ``register_rollout`` as the env awaits it; fetched-to-returned:
  ``fetch_trajectory`` returned -> ``run_rollout`` returned (scoring, unregister, delete);
- RSS per held rollout: peak RSS (sampled every 10 ms) minus RSS before the burst, / N;
- retained: after the burst and the fake world's own records are dropped, a full
  ``gc.collect()`` and a census of live gc-tracked objects by type; the growth of the
  types that grew since the census before the burst, / N.

The earlier side has no seams; in its child process only (never in the library) its
``_http_client`` is replaced by an ``httpx.AsyncClient`` on the fake gateway's
transport after ``init_gateway``, ``Tunnel`` in its module by a fake with the same start
latency, and ``sandbox_client`` by the same fake sandbox client. Its ``poll_interval``
is ``CliAgentEnv``'s default in 0.1.11 (1 s).

Setup of the earlier side (one command; a virtualenv outside the checkout; the repo is
put on its ``PYTHONPATH`` only to import the verifiers-free ``rollout_gateway.testing``)::

    python benchmarks/burst_compare.py --setup-earlier [--earlier-venv DIR]

Usage (with this project's virtualenv)::

    python benchmarks/burst_compare.py --rollouts 100 500 [--rounds 2] [--seed 0]
        [--workers K] [--earlier-venv DIR] [--json results.json]

``--workers K`` spreads the N rollouts over K env processes per side, as prime-rl's
orchestrator does with ``workers_per_env`` ("isolation of event loop lag"): each worker
has its own fake world and env, runs N/K rollouts of its own tasks, and starts each
burst together with the others (a barrier on files). The table then merges the workers:
percentiles over all rollouts' samples, CPU and calls per rollout over all rollouts, the
longest GC pause of any worker. Default 1: the whole burst in one process.

``--earlier-venv`` defaults to ``$ROLLOUT_GATEWAY_EARLIER_VENV`` or
``~/.cache/rollout-gateway/earlier-venv``. Without it, only this project's figures are
printed (and the exit status is 2).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import burst_world as bw  # noqa: E402

# The earlier mixin, and what the verifiers-free fakes import from the repo (orjson).
EARLIER_PINS = (
    "verifiers==0.1.11",
    "prime-sandboxes==0.2.36",
    "httpx==0.28.1",
    "datasets",
    "orjson>=3.13,<4",
)
DEFAULT_EARLIER_VENV = os.environ.get(
    "ROLLOUT_GATEWAY_EARLIER_VENV", str(Path.home() / ".cache/rollout-gateway/earlier-venv")
)
SIDES = ("ours", "earlier")
#: Rollouts of the first burst of a process (the tunnel starts, lazy imports happen).
WARMUP_ROLLOUTS = 4
PHASES = ("warmup", "fresh", "steady")

#: Set by ``--gc-freeze`` for the children: freeze the heap after the warm-up burst.
GC_FREEZE_VAR = "BURST_GC_FREEZE"
#: Task ids of worker i start at i * this (each worker runs its own tasks).
TASKS_PER_WORKER = 1_000_000

# Issue #8's targets.
DETECT_P50_TARGET_MS = 50.0
DETECT_P99_TARGET_MS = 200.0


# ---------------------------------------------------------------------------- the sides


@dataclass
class Side:
    """One side's env and the fakes it runs against."""

    env: Any
    gateway: Any
    sandboxes: Any
    tunnel_starts: Callable[[], int]
    tunnels_alive: Callable[[], int]


def _rubric(vf: Any) -> Any:
    async def made_turns(state: Any) -> float:
        return 1.0 if state.get("trajectory") else 0.0

    return vf.Rubric(funcs=[made_turns])


def _dataset() -> Any:
    from datasets import Dataset

    from rollout_gateway.testing import task_row

    return Dataset.from_list([task_row(i) for i in range(4)])


async def build_ours(world: bw.World) -> Side:
    """This project's env on ``world`` (the one place that knows our fakes' seams)."""
    import verifiers as vf

    from rollout_gateway import GatewaySettings, RolloutGatewayMixin
    from rollout_gateway.testing import FakeTunnelProvider

    gateway = world.make_gateway()
    sandboxes = world.make_sandboxes(gateway)
    tunnels = FakeTunnelProvider(start_latency=bw.TUNNEL_START_LATENCY)
    gateway.watch(sandboxes)  # our launch wrapper reports the start and exit

    class OursEnv(bw.Instrumented, RolloutGatewayMixin, vf.CliAgentEnv):
        """A gateway env as an author writes it (default settings but the seams)."""

    env = OursEnv(
        run_command="python agent.py",
        dataset=_dataset(),
        rubric=_rubric(vf),
        sandbox_client=sandboxes,
        gateway=GatewaySettings(tunnel_provider=tunnels, transport=gateway.transport()),
        sandbox_creations_per_minute=None,
    )
    return Side(
        env,
        gateway,
        sandboxes,
        tunnel_starts=lambda: len(tunnels.opened),
        tunnels_alive=lambda: sum(h.alive for h in tunnels.handles),
    )


async def build_earlier(world: bw.World) -> Side:
    """The earlier experimental mixin's env on ``world``, its internals replaced here."""
    import httpx
    import verifiers as vf
    import verifiers.envs.experimental.rollout_gateway_mixin as earlier
    from verifiers.envs.experimental.cli_agent_env import CliAgentEnv

    gateway = world.make_gateway()
    sandboxes = world.make_sandboxes(gateway)
    earlier.Tunnel = bw.FakePrimeTunnel  # its tunnels are built from the module's name

    class EarlierEnv(bw.Instrumented, earlier.RolloutGatewayMixin, CliAgentEnv):
        """A gateway env as written for the earlier mixin."""

        def __init__(self) -> None:
            super().__init__(run_command="python agent.py", dataset=_dataset(), rubric=_rubric(vf))
            self.init_gateway()

    env = EarlierEnv()
    env.sandbox_client.teardown(wait=False)
    env.sandbox_client = sandboxes
    await env._http_client.aclose()
    env._http_client = httpx.AsyncClient(
        transport=gateway.transport(), timeout=httpx.Timeout(env._gateway_timeout_seconds)
    )
    return Side(
        env,
        gateway,
        sandboxes,
        tunnel_starts=lambda: len(bw.FakePrimeTunnel.started),
        tunnels_alive=lambda: sum(t.is_running for t in bw.FakePrimeTunnel.started),
    )


async def floor_env(name: str) -> Any:
    """The verifiers floor of a side: its ``CliAgentEnv`` with a rollout that does nothing.

    ``run_rollout`` on it pays what verifiers itself costs per rollout on that side's
    version (state init, scoring, the cleanup handlers both mixins run, output
    conversion) and nothing of either mixin. Subtracted from a side's env CPU it gives
    the mixin's own CPU: the two sides run different verifiers (0.3 vs 0.1.11), and
    0.3's own per-rollout work is heavier (signature inspection per handler, a thread
    hop per output).
    """
    import verifiers as vf

    if name == "ours":
        base = vf.CliAgentEnv
    else:
        from verifiers.envs.experimental.cli_agent_env import CliAgentEnv as base

    class FloorEnv(base):  # type: ignore[misc, valid-type]
        """No gateway, no sandbox, no agent: only verifiers' own per-rollout work."""

        async def rollout(self, input: Any, client: Any, model: str, sampling_args: Any = None):
            state = await self.init_state(input, client, model, sampling_args)
            state["trajectory"], state["completion"] = [], []
            cleanup = getattr(self, "_cleanup", None) or self.cleanup  # 0.1.11 / 0.3 name
            await cleanup(state)
            return state

    return FloorEnv(run_command="python agent.py", dataset=_dataset(), rubric=_rubric(vf))


async def run_floor(name: str, client: Any, n: int) -> dict:
    """CPU and GC of ``n`` concurrent do-nothing rollouts on the side's verifiers."""
    from rollout_gateway.testing import task_row

    env = await floor_env(name)

    async def burst() -> None:
        await asyncio.gather(
            *(
                env.run_rollout(task_row(i), client, "policy-model", {"temperature": 1.0})
                for i in range(n)
            )
        )

    await burst()  # warm-up: lazy imports, first-use caches
    gc_timer = bw.GcTimer()
    with gc_timer:
        cpu0 = time.process_time()
        await burst()
        cpu = time.process_time() - cpu0
    return {
        "cpu_ms_per_rollout": cpu / n * 1000,
        "gc_max_pause_cpu_ms": max(gc_timer.cpu_ms, default=0.0),
        "gc_collections": dict(sorted(gc_timer.by_generation.items())),
    }


BUILDERS = {"ours": build_ours, "earlier": build_earlier}


# ---------------------------------------------------------------------------- one side


async def barrier(sync: tuple[Path, int, int] | None, name: str) -> None:
    """Wait until all ``workers`` processes reached ``name`` (``sync`` = dir, index, workers)."""
    if sync is None:
        return
    directory, index, workers = sync
    (directory / f"{name}.{index}").touch()
    while len(list(directory.glob(f"{name}.*"))) < workers:
        await asyncio.sleep(0.005)


def _exit_samples(
    results: list[tuple[str, Any, float]], world: bw.World, probe: Any, reads: dict[str, float]
) -> dict[str, list[float]]:
    """Per rollout, in ms: agent exit -> detected, -> exit report read (exit stream only),
    report read -> detected, and trajectory fetched -> ``run_rollout`` returned."""
    samples: dict[str, list[float]] = {
        "detect_ms": [], "read_ms": [], "confirm_ms": [], "fetched_ms": []
    }  # fmt: skip
    for rid, _, returned in results:
        if rid in probe.detected and rid in world.agent_exit:
            samples["detect_ms"].append((probe.detected[rid] - world.agent_exit[rid]) * 1000)
            if rid in reads:  # the exit stream's delivery, then the rollout's own part
                samples["read_ms"].append((reads[rid] - world.agent_exit[rid]) * 1000)
                samples["confirm_ms"].append((probe.detected[rid] - reads[rid]) * 1000)
        if rid in probe.fetched:
            samples["fetched_ms"].append((returned - probe.fetched[rid]) * 1000)
    return samples


def _latency_figures(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Percentiles of the latency samples (:func:`_exit_samples`, ``register_ms``,
    ``lags_ms``); the report-read ones only with an exit stream (``None`` otherwise)."""
    detect, read, confirm = samples["detect_ms"], samples["read_ms"], samples["confirm_ms"]
    return {
        "detect_n": len(detect),
        "detect_p50_ms": bw.pct(detect, 0.5),
        "detect_p99_ms": bw.pct(detect, 0.99),
        "detect_max_ms": max(detect, default=float("nan")),
        # Only with an exit stream (ours): None on the earlier side.
        "report_read_p50_ms": bw.pct(read, 0.5) if read else None,
        "report_read_p99_ms": bw.pct(read, 0.99) if read else None,
        "read_to_detected_p50_ms": bw.pct(confirm, 0.5) if confirm else None,
        "read_to_detected_p99_ms": bw.pct(confirm, 0.99) if confirm else None,
        "register_p50_ms": bw.pct(samples["register_ms"], 0.5),
        "register_p99_ms": bw.pct(samples["register_ms"], 0.99),
        "fetched_to_returned_p50_ms": bw.pct(samples["fetched_ms"], 0.5),
        "fetched_to_returned_p99_ms": bw.pct(samples["fetched_ms"], 0.99),
        "loop_lag_p50_ms": bw.pct(samples["lags_ms"], 0.5),
        "loop_lag_p99_ms": bw.pct(samples["lags_ms"], 0.99),
    }


def _gc_figures(gc_timer: bw.GcTimer) -> dict[str, Any]:
    """The garbage collector's pauses during the burst."""
    return {
        "gc_max_pause_ms": max(gc_timer.pauses_ms, default=0.0),
        "gc_max_pause_cpu_ms": max(gc_timer.cpu_ms, default=0.0),
        "gc_total_ms": sum(gc_timer.pauses_ms),
        "gc_total_cpu_ms": sum(gc_timer.cpu_ms),
        "gc_collections": dict(sorted(gc_timer.by_generation.items())),
    }


def _forget(side: Side, world: bw.World, probe: Any, reads: dict[str, float]) -> None:
    """Drop what the benchmark and the fake world keep (before the retention census)."""
    probe.clear()
    world.agent_exit.clear()
    world.task_of.clear()
    side.gateway.calls.clear()
    reads.clear()
    side.gateway.unregistered.clear()
    side.gateway.cancelled.clear()
    side.sandboxes.sandboxes.clear()
    side.sandboxes.commands.clear()


async def run_burst(
    side: Side,
    world: bw.World,
    client: Any,
    n: int,
    offset: int,
    sync: tuple[Path, int, int] | None = None,
    phase: str = "burst",
) -> dict:
    """``n`` concurrent ``env.run_rollout`` calls on tasks ``offset..offset+n-1``."""
    probe = side.env.probe
    gc_timer = bw.GcTimer()  # made before the census, like the list below
    rss_samples: list[float] = []
    lags_ms: list[float] = []
    census_before = bw.object_census()
    tasks_before = asyncio.all_tasks()
    status_calls_before = side.sandboxes.calls["get_background_job"]
    rss_before = bw.current_rss_kib()
    await barrier(sync, phase)
    sampler = asyncio.ensure_future(bw.sample_rss(rss_samples, lags_ms))
    with gc_timer:
        cpu0, t0 = time.process_time(), time.time()
        results = await asyncio.gather(
            *(_one_rollout(side.env, client, offset + i) for i in range(n))
        )
        cpu, wall = time.process_time() - cpu0, time.time() - t0
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    rss_samples.append(bw.current_rss_kib())

    reads = getattr(side.gateway, "exit_reads", {})
    samples = _exit_samples(results, world, probe, reads)
    samples.update(register_ms=list(probe.register_ms), lags_ms=lags_ms)
    errors = [str(e) for _, e, _ in results if e is not None]
    slowest = max(world.plan(offset + i).total for i in range(n))
    status_calls = side.sandboxes.calls["get_background_job"] - status_calls_before
    figures = {
        "rollouts": n,
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": wall,
        "wall_over_slowest": wall / slowest,
        **_latency_figures(samples),
        "status_calls_per_rollout": status_calls / n,
        "gateway_calls_per_rollout": len(side.gateway.calls) / n,
        "cpu_ms_per_rollout": cpu / n * 1000,
        **_gc_figures(gc_timer),
        "rss_growth_kib_per_rollout": (max(rss_samples) - rss_before) / n,
        "gateway_rollouts_left": len(side.gateway.active),
        "sandboxes_left": len(side.sandboxes.alive),
        # Raw samples, so that the parent can merge workers' percentiles.
        "samples": samples,
        "cpu_s": cpu,
        "slowest_s": slowest,
    }
    # Retention: drop what the benchmark and the fake world keep, then count what is left.
    del results
    _forget(side, world, probe, reads)
    return {**figures, **_retained(census_before, tasks_before, n)}


async def _one_rollout(env: Any, client: Any, task_id: int) -> tuple[str, Any, float]:
    """One ``env.run_rollout`` of the burst: its id, error and when it returned."""
    from rollout_gateway.testing import task_row

    output = await env.run_rollout(
        task_row(task_id),
        client,
        "policy-model",
        {"temperature": 1.0, "max_tokens": 512},
        state_columns=["rollout_id"],
    )
    return output["rollout_id"], output.get("error"), time.time()


def _retained(census_before: Any, tasks_before: set[Any], n: int) -> dict[str, Any]:
    """What the burst left behind once its own records are dropped: objects per rollout
    (the types that grew: one that shrank does not hide one that grew) and tasks."""
    growth = bw.object_census() - census_before
    return {
        "retained_objects_per_rollout": sum(growth.values()) / n,
        "retained_top_types": growth.most_common(6),
        "tasks_left": len(asyncio.all_tasks() - tasks_before),
    }


async def run_side(name: str, n: int, seed: int, sync: tuple[Path, int, int] | None = None) -> dict:
    """Build one side, run the warm-up, fresh and steady bursts, tear it down.

    With ``sync`` (barrier dir, worker index, workers), this process is one of several
    workers: its tasks are its own (numbered from ``index * TASKS_PER_WORKER``) and each
    burst starts when every worker is ready for it.
    """
    import verifiers as vf
    from openai import AsyncOpenAI

    world = bw.World(seed)
    side = await BUILDERS[name](world)
    side.env.probe = bw.Probe()
    client = vf.OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url="http://gateway-0.test:8000/v1", api_key="x")
    )
    warmup = min(WARMUP_ROLLOUTS, n)
    base = sync[1] * TASKS_PER_WORKER if sync is not None else 0
    for task_id in range(base, base + warmup + 2 * n):
        world.plan(task_id)  # drawn now, so the census does not count the cache
    try:
        first = await run_burst(side, world, client, warmup, offset=base)
        if os.environ.get(GC_FREEZE_VAR) == "1":
            # What a trainer process can do after setup: the heap built so far (modules,
            # datasets, the env) leaves the collector's generations for good.
            gc.collect()
            gc.freeze()
        fresh = await run_burst(side, world, client, n, base + warmup, sync, "fresh")
        steady = await run_burst(side, world, client, n, base + warmup + n, sync, "steady")
    finally:
        await side.env._teardown()
    await barrier(sync, "floor")
    floor = await run_floor(name, client, n)
    return {
        "side": name,
        "verifiers": importlib.metadata.version("verifiers"),
        "warmup": first,
        "fresh": fresh,
        "steady": steady,
        "floor": floor,
        "load_average": os.getloadavg(),
        "tunnel_starts": side.tunnel_starts(),
        "tunnels_alive_after_teardown": side.tunnels_alive(),
    }


def child_main(
    name: str, n: int, seed: int, out: str, sync: tuple[Path, int, int] | None = None
) -> int:
    """A child process: one side (or one worker of it), JSON to ``out``."""
    logging.basicConfig(level=logging.ERROR)
    for logger in ("verifiers", "rollout_gateway", "httpx"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    result = asyncio.run(run_side(name, n, seed, sync))
    Path(out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------- the parent


def earlier_python(venv: str) -> Path:
    return Path(venv) / "bin" / "python"


def check_earlier(venv: str) -> str | None:
    """Why the earlier side cannot run from ``venv`` (None when it can)."""
    python = earlier_python(venv)
    if not python.exists():
        return f"no virtualenv at {venv}"
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import verifiers.envs.experimental.rollout_gateway_mixin as m, "
            "verifiers; print(verifiers.__version__)",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"{python} cannot import the earlier mixin: {probe.stderr.strip()[-300:]}"
    if probe.stdout.strip() != "0.1.11":
        return f"{venv} has verifiers {probe.stdout.strip()}, not 0.1.11"
    return None


def setup_earlier(venv: str) -> int:
    """Create the earlier side's virtualenv with the pins it needs."""
    print(f"creating {venv} with {' '.join(EARLIER_PINS)}")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run(
        [str(earlier_python(venv)), "-m", "pip", "install", "-q", *EARLIER_PINS], check=True
    )
    problem = check_earlier(venv)
    print(problem or f"ok: {venv} runs verifiers 0.1.11's RolloutGatewayMixin")
    return 1 if problem else 0


def run_child(name: str, python: str, n: int, seed: int, workers: int = 1) -> dict:
    """Run one side in ``workers`` processes (N split between them); the merged JSON."""
    from rollout_gateway import child_processes

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONNOUSERSITE"] = "1"
    shares = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for index, share in enumerate(shares):
            command = [python, __file__, "--child", name, "--rollouts", str(share)]
            command += ["--seed", str(seed), "--json-out", f"{tmp}/{index}.json"]
            if workers > 1:
                command += ["--worker", f"{tmp}:{index}:{workers}"]
            # Output to a file, not a pipe: a worker blocked on a full pipe would never
            # reach the barrier the others wait at.
            with open(f"{tmp}/{index}.log", "w") as log:
                # Dead with this process, even by kill -9 (a worker waits at a barrier).
                children.append(
                    child_processes.spawn(command, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        for index, child in enumerate(children):
            if child.wait() != 0:
                for other in children:
                    other.kill()
                    other.wait()
                print(Path(f"{tmp}/{index}.log").read_text()[-6000:], file=sys.stderr)
                raise SystemExit(f"{name} child failed (exit {child.returncode})")
        results = [json.loads(Path(f"{tmp}/{i}.json").read_text()) for i in range(workers)]
    result = merge_workers(results)
    result["child_wall_s"] = time.time() - started
    result["workers"] = workers
    return result


def merge_phase(phases: list[dict]) -> dict:
    """One burst's figures over all workers, as if measured on their union."""
    if len(phases) == 1:
        return phases[0]
    n = sum(p["rollouts"] for p in phases)
    samples = {k: [v for p in phases for v in p["samples"][k]] for k in phases[0]["samples"]}
    merged = dict(phases[0])
    merged.update(
        rollouts=n,
        errors=sum(p["errors"] for p in phases),
        error_samples=[e for p in phases for e in p["error_samples"]][:3],
        samples=samples,
        cpu_s=sum(p["cpu_s"] for p in phases),
        detect_n=len(samples["detect_ms"]),
        detect_p50_ms=bw.pct(samples["detect_ms"], 0.5),
        detect_p99_ms=bw.pct(samples["detect_ms"], 0.99),
        detect_max_ms=max(samples["detect_ms"], default=float("nan")),
        report_read_p50_ms=bw.pct(samples["read_ms"], 0.5) if samples["read_ms"] else None,
        report_read_p99_ms=bw.pct(samples["read_ms"], 0.99) if samples["read_ms"] else None,
        read_to_detected_p50_ms=(
            bw.pct(samples["confirm_ms"], 0.5) if samples["confirm_ms"] else None
        ),
        read_to_detected_p99_ms=(
            bw.pct(samples["confirm_ms"], 0.99) if samples["confirm_ms"] else None
        ),
        register_p50_ms=bw.pct(samples["register_ms"], 0.5),
        register_p99_ms=bw.pct(samples["register_ms"], 0.99),
        fetched_to_returned_p50_ms=bw.pct(samples["fetched_ms"], 0.5),
        fetched_to_returned_p99_ms=bw.pct(samples["fetched_ms"], 0.99),
        loop_lag_p50_ms=bw.pct(samples["lags_ms"], 0.5),
        loop_lag_p99_ms=bw.pct(samples["lags_ms"], 0.99),
        wall_s=max(p["wall_s"] for p in phases),
        wall_over_slowest=max(p["wall_s"] for p in phases) / max(p["slowest_s"] for p in phases),
        gc_max_pause_ms=max(p["gc_max_pause_ms"] for p in phases),
        gc_max_pause_cpu_ms=max(p["gc_max_pause_cpu_ms"] for p in phases),
        gc_total_ms=sum(p["gc_total_ms"] for p in phases),
        gc_total_cpu_ms=sum(p["gc_total_cpu_ms"] for p in phases),
        gc_collections={
            gen: sum(p["gc_collections"].get(gen, 0) for p in phases)
            for gen in sorted({g for p in phases for g in p["gc_collections"]})
        },
        gateway_rollouts_left=sum(p["gateway_rollouts_left"] for p in phases),
        sandboxes_left=sum(p["sandboxes_left"] for p in phases),
        tasks_left=sum(p["tasks_left"] for p in phases),
    )
    # Per-rollout means, weighted by each worker's rollouts.
    for key in (
        "cpu_ms_per_rollout",
        "status_calls_per_rollout",
        "gateway_calls_per_rollout",
        "rss_growth_kib_per_rollout",
        "retained_objects_per_rollout",
    ):
        merged[key] = sum(p[key] * p["rollouts"] for p in phases) / n
    return merged


def merge_workers(results: list[dict]) -> dict:
    """A side's figures over its workers (one worker: its own)."""
    merged = dict(results[0])
    for phase in PHASES:
        merged[phase] = merge_phase([r[phase] for r in results])
    if len(results) > 1 and all("floor" in r for r in results):
        floors = [r["floor"] for r in results]
        merged["floor"] = {
            "cpu_ms_per_rollout": statistics.fmean(f["cpu_ms_per_rollout"] for f in floors),
            "gc_max_pause_cpu_ms": max(f["gc_max_pause_cpu_ms"] for f in floors),
        }
    merged["load_average"] = max(r["load_average"] for r in results)
    merged["tunnel_starts"] = sum(r["tunnel_starts"] for r in results)
    merged["tunnels_alive_after_teardown"] = sum(r["tunnels_alive_after_teardown"] for r in results)
    return merged


ROWS: list[tuple[str, str, str, str]] = [
    # label, phase, key, format
    ("completion detected after agent exit p50 (ms)", "steady", "detect_p50_ms", ".1f"),
    ("completion detected after agent exit p99 (ms)", "steady", "detect_p99_ms", ".1f"),
    ("  exit report read off the stream p50 (ms)", "steady", "report_read_p50_ms", ".1f"),
    ("  exit report read off the stream p99 (ms)", "steady", "report_read_p99_ms", ".1f"),
    ("  report read -> detected (confirm) p50 (ms)", "steady", "read_to_detected_p50_ms", ".1f"),
    ("  report read -> detected (confirm) p99 (ms)", "steady", "read_to_detected_p99_ms", ".1f"),
    ("job-status calls per rollout (mean)", "steady", "status_calls_per_rollout", ".2f"),
    ("control-plane calls per rollout (mean)", "steady", "gateway_calls_per_rollout", ".2f"),
    ("env CPU per rollout (ms)", "steady", "cpu_ms_per_rollout", ".1f"),
    ("  of which verifiers' own floor (ms)", "floor", "cpu_ms_per_rollout", ".1f"),
    ("  the mixin's own: env CPU - floor (ms)", "mixin", "cpu_ms_per_rollout", ".1f"),
    ("longest GC pause, wall (ms)", "steady", "gc_max_pause_ms", ".1f"),
    ("longest GC pause, CPU time (ms)", "steady", "gc_max_pause_cpu_ms", ".1f"),
    ("GC time during burst (ms)", "steady", "gc_total_ms", ".1f"),
    ("GC CPU time during burst (ms)", "steady", "gc_total_cpu_ms", ".1f"),
    ("register latency p50, env-side (ms)", "steady", "register_p50_ms", ".1f"),
    ("trajectory fetched -> returned p50 (ms)", "steady", "fetched_to_returned_p50_ms", ".1f"),
    ("RSS per held rollout, fresh burst (KiB)", "fresh", "rss_growth_kib_per_rollout", ".1f"),
    ("RSS per held rollout, steady burst (KiB)", "steady", "rss_growth_kib_per_rollout", ".1f"),
    ("objects retained per rollout, fresh", "fresh", "retained_objects_per_rollout", ".2f"),
    ("objects retained per rollout, steady", "steady", "retained_objects_per_rollout", ".2f"),
    ("tasks left after the burst", "steady", "tasks_left", ".0f"),
    ("event-loop lag p50 (ms, 10 ms tick)", "steady", "loop_lag_p50_ms", ".1f"),
    ("event-loop lag p99 (ms, 10 ms tick)", "steady", "loop_lag_p99_ms", ".1f"),
    ("wall / slowest rollout's own work", "steady", "wall_over_slowest", ".3f"),
    ("errors (all bursts)", "all", "errors", ".0f"),
]


def figure(runs: list[dict], phase: str, key: str) -> float | None:
    """Median over the rounds (every burst summed for ``all``)."""
    if not runs:
        return None
    if phase == "all":
        values = [r["warmup"][key] + r["fresh"][key] + r["steady"][key] for r in runs]
    elif phase == "mixin":  # the steady burst above the side's verifiers floor
        values = [r["steady"][key] - r["floor"][key] for r in runs if "floor" in r]
    elif phase == "floor":
        values = [r["floor"][key] for r in runs if "floor" in r]
    else:
        values = [r[phase][key] for r in runs if r[phase].get(key) is not None]
    return statistics.median(values) if values else None


def burst_checks(ours: list[dict], earlier: list[dict]) -> dict[str, bool]:
    """The targets, each met or not: ours alone, and against the earlier mixin if run."""

    def get(side: list[dict], phase: str, key: str) -> float:
        value = figure(side, phase, key)
        return float("nan") if value is None else value

    checks = {
        f"detection p50 < {DETECT_P50_TARGET_MS:.0f} ms (target at 500)": get(
            ours, "steady", "detect_p50_ms"
        )
        < DETECT_P50_TARGET_MS,
        f"detection p99 < {DETECT_P99_TARGET_MS:.0f} ms (target at 500)": get(
            ours, "steady", "detect_p99_ms"
        )
        < DETECT_P99_TARGET_MS,
        "nothing retained: < 1 object per rollout, no task left": get(
            ours, "steady", "retained_objects_per_rollout"
        )
        < 1
        and get(ours, "steady", "tasks_left") == 0,
        "no errors; no rollout, sandbox or tunnel left": all(
            r[p]["errors"] == 0 and not r[p]["gateway_rollouts_left"] and not r[p]["sandboxes_left"]
            for r in ours
            for p in PHASES
        )
        and all(r["tunnels_alive_after_teardown"] == 0 for r in ours),
    }
    if earlier:
        checks["the mixin's own CPU per rollout (above its verifiers floor) <= earlier's"] = get(
            ours, "mixin", "cpu_ms_per_rollout"
        ) <= get(earlier, "mixin", "cpu_ms_per_rollout")
        for label, key in (
            ("job-status calls per rollout <= earlier's", "status_calls_per_rollout"),
            ("env CPU per rollout <= earlier's", "cpu_ms_per_rollout"),
            ("longest GC pause (wall) <= earlier's", "gc_max_pause_ms"),
            ("longest GC pause (CPU time) <= earlier's", "gc_max_pause_cpu_ms"),
        ):
            checks[label] = get(ours, "steady", key) <= get(earlier, "steady", key)
    return checks


def print_table(n: int, runs: dict[str, list[dict]]) -> dict[str, bool]:
    """The side-by-side table for ``n`` rollouts, then PASS/FAIL lines; the checks."""
    ours, earlier = runs["ours"], runs["earlier"]
    rounds = len(ours)
    workers = ours[0].get("workers", 1) if ours else 1
    spread = f" over {workers} env worker processes per side" if workers > 1 else ""
    if os.environ.get(GC_FREEZE_VAR) == "1":
        spread += ", heap frozen after warm-up (gc.freeze)"
    print(f"\n=== {n} concurrent rollouts{spread}, median of {rounds} round(s) per side ===")
    width = max(len(r[0]) for r in ROWS)
    print(f"{'metric':<{width}} | {'ours':>10} | {'earlier':>10} | {'ours/earlier':>12}")
    print(f"{'-' * width}-+-{'-' * 10}-+-{'-' * 10}-+-{'-' * 12}")
    for label, phase, key, fmt in ROWS:
        a, b = figure(ours, phase, key), figure(earlier, phase, key)
        a_text = format(a, fmt) if a is not None else "-"
        b_text = format(b, fmt) if b is not None else "-"
        if a is None or b is None:
            ratio = "-"
        elif b == 0:
            ratio = "=" if a == 0 else "inf"
        else:
            ratio = f"{a / b:.2f}"
        print(f"{label:<{width}} | {a_text:>10} | {b_text:>10} | {ratio:>12}")
    for name in SIDES:
        for r in runs[name]:
            print(
                f"  {name:<7} verifiers {r['verifiers']}: child {r['child_wall_s']:.0f} s, "
                f"load average at its end {r['load_average'][0]:.1f}, "
                f"tunnel starts {r['tunnel_starts']}, steady GC collections "
                f"{r['steady']['gc_collections']}, retained top types "
                f"{r['steady']['retained_top_types'][:3]}"
            )
            for sample in [s for p in PHASES for s in r[p]["error_samples"]]:
                print(f"    error: {sample[:200]}")

    checks = burst_checks(ours, earlier)
    for label, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {n}: {label}")
    return checks


def parent_main(args: argparse.Namespace) -> int:
    problem = check_earlier(args.earlier_venv)
    sides = list(SIDES)
    if problem:
        print(
            f"EARLIER SIDE MISSING: {problem}.\n"
            f"  Set it up with: python {Path(__file__).relative_to(REPO)} --setup-earlier "
            f"--earlier-venv {args.earlier_venv}\n"
            "  Running this project's side alone (absolute figures, no ratios)."
        )
        sides = ["ours"]
    pythons = {"ours": sys.executable, "earlier": str(earlier_python(args.earlier_venv))}
    everything: dict[str, Any] = {}
    all_ok = True
    for n in args.rollouts:
        runs: dict[str, list[dict]] = {name: [] for name in SIDES}
        for round_ in range(args.rounds):
            for name in sides:  # A B A B: same seed every time
                print(f"[{n}] round {round_ + 1}/{args.rounds}: {name} ...", flush=True)
                runs[name].append(run_child(name, pythons[name], n, args.seed, args.workers))
        everything[str(n)] = runs
        all_ok &= all(print_table(n, runs).values())
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    if problem:
        return 2
    return 0 if all_ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="both sides call gc.freeze() after their warm-up burst (a trainer's option)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="env processes per side (prime-rl workers_per_env)"
    )
    parser.add_argument("--earlier-venv", default=DEFAULT_EARLIER_VENV)
    parser.add_argument("--setup-earlier", action="store_true", help="create the earlier venv")
    parser.add_argument("--json", help="write every child's figures to this file")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # barrier dir:index:workers
    args = parser.parse_args(argv)
    if args.setup_earlier:
        return setup_earlier(args.earlier_venv)
    if any(n < 1 for n in args.rollouts) or args.rounds < 1 or args.workers < 1:
        parser.error("--rollouts, --rounds and --workers must be positive")
    if any(n < args.workers for n in args.rollouts):
        parser.error("each --rollouts figure must be at least --workers")
    if args.gc_freeze:
        os.environ[GC_FREEZE_VAR] = "1"  # the children inherit it
    if args.child:
        sync = None
        if args.worker:
            directory, index, workers = args.worker.rsplit(":", 2)
            sync = (Path(directory), int(index), int(workers))
        return child_main(args.child, args.rollouts[0], args.seed, args.json_out, sync)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
