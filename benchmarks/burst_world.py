"""The seeded fake world of the burst benchmarks, and what they measure in it.

Verifiers-free (it imports only :mod:`rollout_gateway.testing` and the standard
library), so the same world runs under this project's verifiers 0.3 and under the
earlier experimental mixin's verifiers 0.1.11, each in its own virtualenv
(``benchmarks/burst_compare.py``).

Same seed, same world, whatever the env does:

- each rollout's work is drawn from ``Random(f"{seed}:{task_id}")``: sandbox create
  100-500 ms, ready 0-50 ms, agent 0.5-2 s split over 2-5 turns recorded through
  ``gateway.add_turn`` with token ids (prompts of a few hundred tokens, growing);
- the k-th control-plane call of an operation (register, trajectory, unregister...)
  takes the k-th draw of ``Random(f"{seed}:gateway:{op}")``, 2-10 ms; the k-th sandbox
  API call of a method (start job, job status, delete...) the k-th draw of
  ``Random(f"{seed}:sandbox:{method}")``, 5-20 ms;
- a tunnel takes 1 s to start.

The env tells the world which task a sandbox runs through the sandbox's environment
(``BENCH_TASK_ID``, set by :class:`Instrumented`), as an env author passes a task to an
agent.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from rollout_gateway.testing import (
    FakeExitStream,
    FakeGateway,
    FakeSandbox,
    FakeSandboxClient,
    rollout_id_of,
)

# Latencies (seconds).
GATEWAY_LATENCY = (0.002, 0.010)
SANDBOX_API_LATENCY = (0.005, 0.020)
CREATE_LATENCY = (0.100, 0.500)
READY_LATENCY = (0.0, 0.050)
AGENT_WORK = (0.5, 2.0)
AGENT_TURNS = (2, 5)
TUNNEL_START_LATENCY = 1.0

VOCAB = 150_000
#: Sandbox environment variable naming the rollout's task (see :class:`Instrumented`).
TASK_VAR = "BENCH_TASK_ID"


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout's simulated work, drawn from the seed and the task id."""

    create: float
    ready: float
    agent: float
    shares: tuple[float, ...]  # of ``agent``, per turn
    prompt_len: int
    completion_lens: tuple[int, ...]
    tool_lens: tuple[int, ...]
    token_offsets: tuple[int, ...]

    @property
    def total(self) -> float:
        """Create + ready + agent seconds: the rollout's own work."""
        return self.create + self.ready + self.agent


def plan_rollout(seed: int, task_id: int, pool_size: int) -> RolloutPlan:
    """The work of task ``task_id`` under ``seed`` (the same on every side)."""
    rng = random.Random(f"{seed}:{task_id}")
    turns = rng.randint(*AGENT_TURNS)
    cuts = sorted(rng.random() for _ in range(turns - 1))
    return RolloutPlan(
        create=rng.uniform(*CREATE_LATENCY),
        ready=rng.uniform(*READY_LATENCY),
        agent=rng.uniform(*AGENT_WORK),
        shares=tuple(b - a for a, b in zip([0.0, *cuts], [*cuts, 1.0], strict=True)),
        prompt_len=rng.randint(200, 600),
        completion_lens=tuple(rng.randint(30, 200) for _ in range(turns)),
        tool_lens=tuple(rng.randint(50, 300) for _ in range(turns)),
        token_offsets=tuple(rng.randrange(pool_size - 8192) for _ in range(2 * turns)),
    )


class LatencyTable:
    """The k-th call of each operation gets the k-th draw of its own seeded stream."""

    def __init__(self, seed: int, kind: str, bounds: tuple[float, float]) -> None:
        self.seed, self.kind, self.bounds = seed, kind, bounds
        self._streams: dict[str, random.Random] = {}

    def next(self, op: str) -> float:
        """Seconds for the next call of ``op``."""
        stream = self._streams.get(op)
        if stream is None:
            stream = self._streams[op] = random.Random(f"{self.seed}:{self.kind}:{op}")
        return stream.uniform(*self.bounds)


class TokenPool:
    """Token ids and logprobs drawn once from the seed, sliced per turn.

    A real agent runs in its sandbox and the gateway produces the token ids; drawing
    them on the env's event loop would measure the benchmark, not the env.
    """

    def __init__(self, seed: int, size: int = 1 << 16) -> None:
        rng = random.Random(f"{seed}:tokens")
        self.ids = [rng.randrange(VOCAB) for _ in range(size)]
        self.logprobs = [-rng.random() for _ in range(size)]

    def record(self, prompt_len: int, completion_len: int, offsets: tuple[int, int]) -> dict:
        """A step's token record as the gateway sends it."""
        p, c = offsets
        return {
            "prompt_ids": self.ids[p : p + prompt_len],
            "prompt_mask": [0] * prompt_len,
            "completion_ids": self.ids[c : c + completion_len],
            "completion_mask": [1] * completion_len,
            "completion_logprobs": self.logprobs[c : c + completion_len],
            "overlong_prompt": False,
            "is_truncated": False,
        }


class SeededGateway(FakeGateway):
    """:class:`FakeGateway` whose latency per call comes from a :class:`LatencyTable`."""

    def __init__(self, latencies: LatencyTable, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.latencies = latencies
        #: time.time() when the env read each rollout's exit report off the exit stream.
        self.exit_reads: dict[str, float] = {}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """Sleep the call's seeded latency, then answer as the fake gateway."""
        op = "/".join(request.url.path.strip("/").split("/")[3:]) or request.url.path
        await asyncio.sleep(self.latencies.next(op))
        response = await super().handle(request)
        if isinstance(response.stream, FakeExitStream):
            response.stream = ReadTimes(response.stream, self.exit_reads)
        return response


class ReadTimes(httpx.AsyncByteStream):
    """An exit stream that notes when the env's watcher reads each report.

    The fake stream runs in the reader's task (an httpx mock transport), so the moment
    a chunk is yielded is the moment the watcher takes it and resolves the rollout's
    future: the report's delivery, before the rollout's own task runs again.
    """

    def __init__(self, inner: FakeExitStream, reads: dict[str, float]) -> None:
        self.inner = inner
        self.reads = reads

    async def __aiter__(self) -> Any:
        async for chunk in self.inner:
            now = time.time()
            for line in chunk.splitlines():
                if b'"rollout_id"' in line:
                    self.reads[orjson.loads(line)["rollout_id"]] = now
            yield chunk

    async def aclose(self) -> None:
        """Close the wrapped stream."""
        await self.inner.aclose()


class SeededSandboxClient(FakeSandboxClient):
    """:class:`FakeSandboxClient` with the task's create/ready times and seeded API latencies."""

    def __init__(self, world: World, agent: Any, **kwargs: Any) -> None:
        super().__init__(agent, **kwargs)
        self.world = world

    def _plan_of(self, request: Any) -> RolloutPlan:
        return self.world.plan(int(request.environment_vars[TASK_VAR]))

    async def _api(self, method: str) -> None:
        await asyncio.sleep(self.world.sandbox_latency.next(method))

    async def create(self, request: Any) -> Any:
        """Create, taking the task's create time."""
        await asyncio.sleep(self._plan_of(request).create)
        return await super().create(request)

    async def wait_for_creation(self, sandbox_id: str, **kwargs: Any) -> None:
        """Ready, after the task's ready time."""
        await asyncio.sleep(self._plan_of(self.sandboxes[sandbox_id].request).ready)
        await super().wait_for_creation(sandbox_id, **kwargs)

    async def start_background_job(self, sandbox_id: str, command: str, **kwargs: Any) -> Any:
        """Start the agent (after an API latency)."""
        await self._api("start_background_job")
        return await super().start_background_job(sandbox_id, command, **kwargs)

    async def get_background_job(self, sandbox_id: str, job: Any, timeout: Any = None) -> Any:
        """The job status (after an API latency)."""
        await self._api("get_background_job")
        return await super().get_background_job(sandbox_id, job, timeout)

    async def execute_command(self, sandbox_id: str, command: str, **kwargs: Any) -> Any:
        """A command (after an API latency)."""
        await self._api("execute_command")
        return await super().execute_command(sandbox_id, command, **kwargs)

    async def delete(self, sandbox_id: str) -> Any:
        """Delete (after an API latency)."""
        await self._api("delete")
        return await super().delete(sandbox_id)


class FakePrimeTunnel:
    """Stands in for ``prime_tunnel.Tunnel`` (the earlier mixin builds it directly)."""

    start_latency = TUNNEL_START_LATENCY
    started: list[FakePrimeTunnel] = []

    def __init__(self, local_port: int, local_addr: str = "127.0.0.1", **kwargs: Any) -> None:
        self.local_port, self.local_addr = local_port, local_addr
        self.tunnel_id: str | None = None
        self.url: str | None = None
        self.is_running = False
        self.recent_output: list[str] = []

    async def start(self) -> str:
        """Start after ``start_latency`` seconds; returns the public URL."""
        await asyncio.sleep(self.start_latency)
        FakePrimeTunnel.started.append(self)
        self.tunnel_id = f"tun-{len(FakePrimeTunnel.started)}"
        self.url = f"https://{self.tunnel_id}.example"
        self.is_running = True
        return self.url

    def sync_stop(self) -> None:
        """Stop."""
        self.is_running = False

    async def stop(self) -> None:
        """Stop."""
        self.sync_stop()


@dataclass
class World:
    """The fake world of one side's process: gateway, sandboxes, agents, records."""

    seed: int
    pool: TokenPool = field(init=False)
    gateway_latency: LatencyTable = field(init=False)
    sandbox_latency: LatencyTable = field(init=False)
    plans: dict[int, RolloutPlan] = field(default_factory=dict)
    #: rollout id -> time.time() when its agent coroutine returned.
    agent_exit: dict[str, float] = field(default_factory=dict)
    task_of: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pool = TokenPool(self.seed)
        self.gateway_latency = LatencyTable(self.seed, "gateway", GATEWAY_LATENCY)
        self.sandbox_latency = LatencyTable(self.seed, "sandbox", SANDBOX_API_LATENCY)

    def plan(self, task_id: int) -> RolloutPlan:
        """The work of ``task_id``."""
        plan = self.plans.get(task_id)
        if plan is None:
            plan = self.plans[task_id] = plan_rollout(self.seed, task_id, len(self.pool.ids))
        return plan

    def make_gateway(self, **kwargs: Any) -> SeededGateway:
        """The fake gateway, with seeded latencies."""
        return SeededGateway(self.gateway_latency, **kwargs)

    def make_sandboxes(self, gateway: FakeGateway, **kwargs: Any) -> SeededSandboxClient:
        """The fake sandbox client whose agents record their turns at ``gateway``."""
        return SeededSandboxClient(self, self.agent(gateway), **kwargs)

    def agent(self, gateway: FakeGateway) -> Any:
        """The agent process: a multi-turn tool-using loop recorded by the gateway."""

        async def agent(sandbox: FakeSandbox) -> int:
            rid = rollout_id_of(sandbox)
            task_id = int(sandbox.env_vars[TASK_VAR])
            self.task_of[rid] = task_id
            plan = self.plan(task_id)
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix bug #{task_id}"},
            ]
            prompt_len = plan.prompt_len
            turns = len(plan.shares)
            for turn, share in enumerate(plan.shares):
                await asyncio.sleep(plan.agent * share)
                if turn == turns - 1:
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
                offsets = plan.token_offsets[2 * turn : 2 * turn + 2]
                tokens = self.pool.record(prompt_len, plan.completion_lens[turn], offsets)
                gateway.add_turn(rid, list(messages), [reply], tokens=tokens)
                messages += [reply, {"role": "tool", "tool_call_id": f"c{turn}", "content": "ok"}]
                prompt_len += plan.completion_lens[turn] + plan.tool_lens[turn]
            self.agent_exit[rid] = time.time()
            return 0

        return agent


@dataclass
class Probe:
    """What :class:`Instrumented` observes inside the env, per rollout id."""

    register_ms: list[float] = field(default_factory=list)
    #: time.time() when ``wait_for_agent_completion`` returned (completion detected).
    detected: dict[str, float] = field(default_factory=dict)
    #: time.time() when ``fetch_trajectory`` returned.
    fetched: dict[str, float] = field(default_factory=dict)

    def clear(self) -> None:
        """Forget everything (between bursts)."""
        self.register_ms.clear()
        self.detected.clear()
        self.fetched.clear()


class Instrumented:
    """Env steps wrapped to time them; put first in the bases of either side's env.

    Both mixins route a rollout through overridable steps of the same names and
    signatures (``register_rollout``, ``wait_for_agent_completion``,
    ``fetch_trajectory``, ``build_env_vars``), so the same wrappers observe both sides.
    """

    probe: Probe

    async def build_env_vars(self, state: Any) -> dict[str, str]:
        """The mixin's variables plus the task id (an env author passing the task)."""
        env_vars = await super().build_env_vars(state)  # type: ignore[misc]
        env_vars[TASK_VAR] = str(state["info"]["task_id"])
        return env_vars

    async def register_rollout(self, state: Any) -> None:
        """Register, timed as the env sees it."""
        t0 = time.perf_counter()
        await super().register_rollout(state)  # type: ignore[misc]
        self.probe.register_ms.append((time.perf_counter() - t0) * 1000)

    async def wait_for_agent_completion(self, state: Any) -> None:
        """Wait; its return is the moment the env knows the agent exited."""
        await super().wait_for_agent_completion(state)  # type: ignore[misc]
        self.probe.detected[state["rollout_id"]] = time.time()

    async def fetch_trajectory(self, state: Any) -> None:
        """Fetch; its return starts the fetched-to-returned interval."""
        await super().fetch_trajectory(state)  # type: ignore[misc]
        self.probe.fetched[state["rollout_id"]] = time.time()


class GcTimer:
    """Times every garbage collection through ``gc.callbacks`` while active.

    ``pauses_ms`` is wall time (what the event loop waits); ``cpu_ms`` the thread's CPU
    time in the collection, which a busy shared machine does not inflate.
    """

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self.cpu_ms: list[float] = []
        self.by_generation: Counter[int] = Counter()
        self._start = self._start_cpu = 0.0
        self.active = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start, self._start_cpu = time.perf_counter(), time.thread_time()
        elif self.active:
            self.pauses_ms.append((time.perf_counter() - self._start) * 1000)
            self.cpu_ms.append((time.thread_time() - self._start_cpu) * 1000)
            self.by_generation[info.get("generation", -1)] += 1

    def __enter__(self) -> GcTimer:
        self.pauses_ms.clear()
        self.cpu_ms.clear()
        self.by_generation.clear()
        self.active = True
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False
        gc.callbacks.remove(self._callback)


def current_rss_kib() -> float:
    """Resident set size now (Linux ``/proc/self/statm``), KiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * (_PAGE_SIZE // 1024)


_PAGE_SIZE = __import__("os").sysconf("SC_PAGE_SIZE")


async def sample_rss(
    samples: list[float], lags_ms: list[float] | None = None, period: float = 0.01
) -> None:
    """Append the RSS every ``period`` seconds (until cancelled), and to ``lags_ms`` how
    late the event loop woke this ``period`` sleep (how saturated the loop is)."""
    while True:
        samples.append(current_rss_kib())
        t0 = time.monotonic()
        await asyncio.sleep(period)
        if lags_ms is not None:
            lags_ms.append((time.monotonic() - t0 - period) * 1000)


def object_census() -> Counter[str]:
    """Live gc-tracked objects by type name, after a full collection."""
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1), nearest-rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]
