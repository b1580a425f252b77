"""What a turn costs through the gateway, side by side with a plain pass-through proxy.

Starts, each in its own process on loopback: the scripted model, the gateway
(``rollout-gateway serve``) and a plain pass-through proxy (aiohttp, forwards the request
and answer bytes, nothing else). Then, in one run, for each context size and concurrency it
replays the same multi-turn tool-calling conversations (a) straight to the model, (b)
through the proxy, (c) through the gateway, and prints side by side:

* CPU per turn of the proxy process and of the gateway process (and of the model behind
  each: it must not work harder behind the gateway), and of the load generator itself
  (with the cores it kept busy: on a small machine it competes with what it measures);
* the gateway's own extra CPU per turn beyond the proxy's (gateway - proxy), and each CPU
  figure at the largest context against the smallest: the proxy moves the same bytes, so
  the extra shows whether the gateway's own work grows with the context;
* latency added to a turn (p50 / p99 over the direct run's);
* for the gateway at the largest context: trajectory fetch time and size (the table's
  answer and ``?format=delta``);
* bytes the recorder holds per stored token;
* gateway RSS: at start, after a burst of ``--burst`` rollouts, after they are unregistered;
* CPU per second of each server process while idle (``--idle-seconds``, after the warm-up):
  what a quiet server spends on its own timers, which a paced run (``--model-latency-ms``)
  adds to every turn at low concurrency.

Every request asks for token ids and logprobs in every run, so the model does the same
work and the differences are the hop's. Example (the figures in the issue's closing note)::

    python benchmarks/gateway_overhead.py --turns 40 --contexts 1000,32000 --concurrency 1,64

By default the model answers at once and one asyncio loop in this process drives every
rollout, back to back: at 64 rollouts on a small machine that saturates the CPU, and every
figure of the cell is queueing. A real model takes hundreds of ms to seconds per turn, so
64 rollouts offer far less load. To measure that:

* ``--model-latency-ms MS``: the scripted model sleeps MS per completion (no CPU; every
  path goes to the same model, so the added latency is still path minus direct). The
  rollouts of a cell then start spread evenly over one model latency, as rollouts whose
  turns take different times are in practice; ``--lockstep`` starts them all at once.
* ``--clients P``: each cell's rollouts are spread over P load-generator processes
  (``--load-client``, a share each), started together once all are ready; each reports its
  latencies and CPU as one JSON line, and the parent merges them.

    python benchmarks/gateway_overhead.py --turns 40 --contexts 1000,32000 \
        --concurrency 1,64 --model-latency-ms 500 --clients 4

CPU is read from Linux's per-process CPU clocks (nanoseconds; ``/proc`` ticks as a
fallback); the machine is shared, so compare ratios of one run. Within a cell the paths
take turns round by round (as many rounds as ``--min-turns`` needs), so a drift of the
machine over the cell's seconds weighs on every path alike. To compare two versions of
the gateway in one run (A/B), pass the other version's source tree: ``--compare-source
/path/to/checkout`` starts a second gateway from it (``base``), measured in the same cells,
and prints gateway/base ratios.

``--stack-floor`` adds two more paths, each its own process: ``stack``, the gateway's HTTP
stack alone (uvicorn with httptools on uvloop, the gateway's upstream client,
``Http1Upstream``) forwarding the bytes,
and ``json``, the same plus the JSON work any recording gateway does on a turn (the request
parsed and written again, the answer parsed without its prompt ids, as the gateway does).
Their ratios to the proxy say what the stack costs; gateway/json says what the gateway's
own work per turn (checks, history match, recording, bookkeeping) adds on top.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import socket
import statistics
import sys
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rollout_gateway import child_processes
from rollout_gateway.server.recording.recorder import TrajectoryRecorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
from support.servers import serving  # noqa: E402

ADMIN_TOKEN = "benchmark-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# -- the pass-through proxy (baseline) -------------------------------------------------------


def run_proxy(port: int, upstream_root: str, loop: str = "asyncio") -> None:
    """A plain aiohttp reverse proxy: request bytes in, answer bytes out (no parsing), on
    asyncio's event loop or (``loop="uvloop"``) on the gateway's."""
    import aiohttp
    from aiohttp import web

    if loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    hop = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}
    keep = {"content-type", "date"}

    async def on_startup(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        app["session"] = aiohttp.ClientSession(upstream_root, connector=connector)

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        async with request.app["session"].request(
            request.method, request.rel_url, data=await request.read(), headers=headers
        ) as upstream:
            body = await upstream.read()
            # The origin's Date, as proxies pass it on (writing one costs the proxy a
            # formatting once a second with requests: work that follows the wall clock).
            kept = {"content-type": "application/json"}
            kept.update((k, v) for k, v in upstream.headers.items() if k.lower() in keep)
            return web.Response(body=body, status=upstream.status, headers=kept)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run_stack_floor(port: int, upstream_root: str, json_work: bool) -> None:
    """The gateway's HTTP stack alone: uvicorn (httptools, uvloop) and the gateway's
    upstream client (:class:`Http1Upstream`), forwarding bytes; with ``json_work``, also
    the JSON work every recording gateway does."""
    import orjson
    import uvicorn

    from rollout_gateway.server.engines.upstream_http1 import Http1Upstream
    from rollout_gateway.server.recording.prompt_ids import split_prompt_ids

    clients: list[Http1Upstream] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    clients.append(Http1Upstream(upstream_root))
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await clients[0].aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if json_work and body:
            body = orjson.dumps(orjson.loads(body))
        if scope["method"] == "POST":
            upstream = await clients[0].post(scope["path"], body)
        else:
            upstream = await clients[0].get(scope["path"], timeout_s=60)
        answer, status = upstream.content, upstream.status_code
        if json_work and scope["method"] == "POST":
            orjson.loads(split_prompt_ids(answer)[0])
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": answer})

    uvicorn.run(
        app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
        log_level="warning", access_log=False,
    )  # fmt: skip


# -- processes ---------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[float, int]:
    """(user+system CPU seconds, RSS bytes) of a process (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return _process_cpu_clock(pid, cpu), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0.0, 0


def _process_cpu_clock(pid: int, fallback: float) -> float:
    """The process's CPU time to the nanosecond (Linux's process CPU clock of ``pid``, all
    its threads, dead ones included), instead of ``/proc``'s 10 ms ticks: a cell of a few
    hundred ~1 ms turns is then measured to well under 1%."""
    clock_id = (~pid << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    try:
        return time.clock_gettime(clock_id)
    except OSError:
        return fallback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _process(
    cmd: list[str], health_url: str, env: dict[str, str] | None = None, cwd: str | None = None
) -> Iterator[int]:
    """``cmd`` serving (dead with this process, even by ``kill -9``), once ``health_url``
    answers 200; its pid. Its process group is stopped on the way out."""
    with serving(
        cmd, health_url, env=env, cwd=cwd, headers=ADMIN, ready=lambda status: status == 200
    ) as proc:
        yield proc.pid


# -- load ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[list[str], list[float]]:
    """5,000 made-up words and their cumulative Zipf weights (deterministic)."""
    rng = random.Random(26)
    syllables = [c + v for c in "bcdfghklmnprstvwyz" for v in "aeiou"]
    syllables += ["th", "ng", "st", "er", "in", "on", "an", "re", "ed", "es"]
    words: set[str] = set()
    while len(words) < 5000:
        words.add("".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 2, 3, 3, 4)))))
    ordered = sorted(words)
    rng.shuffle(ordered)
    return ordered, list(itertools.accumulate(1 / (rank + 2.7) for rank in range(len(ordered))))


@functools.lru_cache(maxsize=256)
def realistic_text(chars: int, seed: int) -> str:
    """``chars`` characters of made-up English-like text: words drawn by Zipf's law from
    5,000, in sentences and lines. zlib compresses it about as it compresses English prose
    (docs/performance.md gives both): the text of ``--text realistic``."""
    words, weights = _vocabulary()
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choices(words, cum_weights=weights, k=rng.randint(5, 18)))
        part = sentence.capitalize() + rng.choice(".,.?:") + rng.choice("   \n")
        parts.append(part)
        size += len(part)
    return "".join(parts)[:chars]


def _first_messages(turns: int, context_tokens: int, bytes_per_token: int = 1) -> list[dict]:
    """A rollout's first messages: a script of ``turns`` turns, a system prompt padding the
    prompt to ``context_tokens`` tokens (of the scripted model's tokenizer: 1 byte each,
    or ``bytes_per_token`` of made-up text, :func:`realistic_text`)."""
    steps = [{"tool": "run", "arguments": {"cmd": f"step {i}"}} for i in range(turns - 1)]
    steps.append({"say": "finished"})
    task = f"Benchmark task. <script>{json.dumps(steps)}</script>"
    padding = max(0, context_tokens - len(task) // bytes_per_token - 64) * bytes_per_token
    if bytes_per_token == 1:
        system = "You are a CLI agent. " + ("context " * (padding // 8 + 1))[:padding]
    else:
        system = "You are a CLI agent. " + realistic_text(padding, context_tokens)
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


def _tool_output(turn: int, chars: int, bytes_per_token: int, url: str) -> str:
    """A tool's output: ``chars`` tokens of the scripted model's tokenizer."""
    if bytes_per_token == 1:
        return (f"output of turn {turn} " * (chars // 16 + 1))[:chars]
    return realistic_text(chars * bytes_per_token, zlib.crc32(f"{url} {turn}".encode()))


@dataclass
class Target:
    name: str
    root: str
    pid: int | None
    gateway: bool = False


@dataclass
class RunResult:
    latencies_s: list[float]
    wall_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)  # process name -> CPU seconds
    trajectory: tuple[float, int, float, int] | None = None
    loadgen_cpu_s: float = 0.0  # the load generator's own CPU (all its processes)

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _rollout(
    client: httpx.AsyncClient,
    url: str,
    turns: int,
    context_tokens: int,
    latencies: list[float],
    tool_chars: int,
    start_delay_s: float = 0.0,
    bytes_per_token: int = 1,
) -> None:
    messages = _first_messages(turns, context_tokens, bytes_per_token)
    if start_delay_s > 0:
        await asyncio.sleep(start_delay_s)
    for turn in range(turns):
        body = {
            "model": "scripted",
            "messages": messages,
            "return_token_ids": True,
            "logprobs": True,
        }
        start = time.perf_counter()
        r = await client.post(url, json=body)
        latencies.append(time.perf_counter() - start)
        r.raise_for_status()
        message = r.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        for call in message.get("tool_calls") or ():
            output = _tool_output(turn, tool_chars, bytes_per_token, url)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})


@dataclass
class Agent:
    """One rollout as the load generator drives it: its chat URL, bearer key and start delay."""

    url: str
    key: str
    start_delay_s: float = 0.0


@dataclass
class Load:
    """One round of a cell: every rollout's agent, all against one target root."""

    root: str
    agents: list[Agent]
    turns: int
    context_tokens: int
    tool_chars: int
    #: The scripted model's bytes per token (``--text realistic``: 4, and made-up text).
    bytes_per_token: int = 1


@dataclass
class ClientTotals:
    """The load-generator processes' reports, merged."""

    latencies_s: list[float]
    cpu_s: float


def merge_client_reports(reports: list[dict], expected_turns: int) -> ClientTotals:
    """Merge the JSON reports of the load-generator processes of one round.

    Every turn of every rollout must be in exactly one report: a client that lost turns
    would make the per-turn figures of the round wrong, so that is an error.
    """
    latencies = [x for report in reports for x in report["latencies_s"]]
    if len(latencies) != expected_turns:
        raise ValueError(f"load clients reported {len(latencies)} turns, expected {expected_turns}")
    return ClientTotals(latencies, sum(float(report["cpu_s"]) for report in reports))


def split_agents(agents: list[Agent], clients: int) -> list[list[Agent]]:
    """``agents`` dealt round-robin over at most ``clients`` non-empty shares."""
    shares = max(1, min(clients, len(agents)))
    return [agents[i::shares] for i in range(shares)]


def _cpu_of(pids: dict[str, int]) -> dict[str, float]:
    return {name: _proc_stat(pid)[0] for name, pid in pids.items()}


def _cpu_since(pids: dict[str, int], before: dict[str, float]) -> dict[str, float]:
    return {name: cpu - before[name] for name, cpu in _cpu_of(pids).items()}


def _idle_cpu_ms_per_s(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """CPU milliseconds per second each process spends while nothing is sent to it."""
    if seconds <= 0:
        return {}
    before = _cpu_of(pids)
    time.sleep(seconds)
    return {name: cpu * 1000 / seconds for name, cpu in _cpu_since(pids, before).items()}


@contextlib.asynccontextmanager
async def _agent_clients(load: Load, agents: list[Agent]) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One HTTP client per agent (one agent process each, in reality), made before the
    measured part of a round (a client's TLS context alone costs milliseconds)."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=load.root, timeout=120, headers={"Authorization": f"Bearer {a.key}"}
                )
            )
            for a in agents
        ]


async def _drive_agents(
    load: Load, agents: list[Agent], clients: list[httpx.AsyncClient], latencies: list[float]
) -> None:
    """Run ``agents``' conversations concurrently, each through its own client."""
    await asyncio.gather(
        *(
            _rollout(c, a.url, load.turns, load.context_tokens, latencies, load.tool_chars,
                     a.start_delay_s, load.bytes_per_token)
            for c, a in zip(clients, agents, strict=True)
        )
    )  # fmt: skip


async def _drive_here(load: Load, pids: dict[str, int]) -> RunResult:
    """The round in this process's event loop (``--clients 1``)."""
    latencies: list[float] = []
    async with _agent_clients(load, load.agents) as clients:
        before, own_cpu, start = _cpu_of(pids), time.process_time(), time.perf_counter()
        await _drive_agents(load, load.agents, clients, latencies)
        wall = time.perf_counter() - start
        result = RunResult(latencies, wall, _cpu_since(pids, before))
        result.loadgen_cpu_s = time.process_time() - own_cpu
    return result


async def _start_client(load: Load, agents: list[Agent]) -> asyncio.subprocess.Process:
    """A load-generator process (``--load-client``), given its share."""
    proc = await child_processes.spawn_async(
        sys.executable, __file__, "--load-client",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26,
    )  # fmt: skip
    assert proc.stdin is not None
    spec = {**asdict(load), "agents": [asdict(a) for a in agents]}
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    await proc.stdin.drain()
    return proc


async def _client_ready(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    if (await proc.stdout.readline()).strip() != b"ready":
        raise RuntimeError("load client did not get ready")


async def _client_report(proc: asyncio.subprocess.Process) -> dict:
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if not line:
        raise RuntimeError(f"load client exited with {await proc.wait()} without a report")
    return json.loads(line)


async def _drive_clients(load: Load, clients: int, pids: dict[str, int]) -> RunResult:
    """The round spread over ``clients`` load-generator processes, started together once
    all are ready (connections are opened in the round, as in ``_drive_here``)."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for share in split_agents(load.agents, clients):
            procs.append(await _start_client(load, share))
        await asyncio.gather(*(_client_ready(p) for p in procs))
        before, start = _cpu_of(pids), time.perf_counter()
        for proc in procs:  # the barrier: every client is waiting for this line
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
        reports = await asyncio.gather(*(_client_report(p) for p in procs))
        wall = time.perf_counter() - start
        cpu = _cpu_since(pids, before)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    totals = merge_client_reports(reports, len(load.agents) * load.turns)
    return RunResult(totals.latencies_s, wall, cpu, loadgen_cpu_s=totals.cpu_s)


async def _serve_as_client() -> None:
    """``--load-client``: read a share (one JSON line), say ``ready``, wait for ``go``, run
    it, print one JSON report (latencies and this process's CPU while it ran)."""
    spec = json.loads(sys.stdin.readline())
    load = Load(**{**spec, "agents": [Agent(**a) for a in spec["agents"]]})
    # A first request imports what httpx loads lazily (tens of ms): not in a measured turn.
    async with httpx.AsyncClient(base_url=load.root, timeout=120) as warm_up:
        await warm_up.get("/health")
    async with _agent_clients(load, load.agents) as clients:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        latencies: list[float] = []
        own_cpu = time.process_time()
        await _drive_agents(load, load.agents, clients, latencies)
        report = {"latencies_s": latencies, "cpu_s": time.process_time() - own_cpu}
    print(json.dumps(report), flush=True)


def rounds_for(min_turns: int, rollouts: int, turns: int) -> int:
    """Rounds of ``rollouts`` conversations of ``turns`` turns that measure at least
    ``min_turns`` turns (at least one)."""
    return max(1, -(-min_turns // (rollouts * turns)))


def merge_run(total: RunResult, res: RunResult) -> RunResult:
    """Add one round's figures to ``total`` (in place; returned): latencies joined, wall
    and CPU times summed, the first trajectory kept."""
    total.latencies_s += res.latencies_s
    total.wall_s += res.wall_s
    total.loadgen_cpu_s += res.loadgen_cpu_s
    for name, cpu in res.cpu_s.items():
        total.cpu_s[name] = total.cpu_s.get(name, 0.0) + cpu
    total.trajectory = total.trajectory or res.trajectory
    return total


async def _register(control: httpx.AsyncClient, ids: list[str]) -> list[str]:
    """Register every rollout at the gateway; their per-rollout keys."""
    keys = []
    for rid in ids:
        reg = {"model": "scripted", "sampling_params": {"temperature": 0}, "max_turns": -1}
        r = await control.post(f"/v1/rollouts/{rid}/register", json=reg)
        r.raise_for_status()
        keys.append(r.json()["api_key"])
    return keys


async def _fetch_trajectory(
    control: httpx.AsyncClient, rid: str, turns: int
) -> tuple[float, int, float, int]:
    """(seconds, bytes) of the trajectory's table form, then of its delta form."""
    t0 = time.perf_counter()
    full = await control.get(f"/v1/rollouts/{rid}/trajectory")
    t1 = time.perf_counter()
    delta = await control.get(f"/v1/rollouts/{rid}/trajectory?format=delta")
    t2 = time.perf_counter()
    assert full.json()["num_turns"] == turns
    return (t1 - t0, len(full.content), t2 - t1, len(delta.content))


def _chat_url(target: Target, rid: str) -> str:
    return f"/v1/rollouts/{rid}/chat/completions" if target.gateway else "/v1/chat/completions"


async def _one_round(
    target: Target,
    pids: dict[str, int],
    *,
    rollouts: int,
    turns: int,
    context_tokens: int,
    tool_chars: int,
    fetch_trajectory: bool = False,
    clients: int = 1,
    start_spread_s: float = 0.0,
    bytes_per_token: int = 1,
) -> RunResult:
    """One round: register (gateway), drive every rollout, fetch one trajectory, unregister.
    Rollout ``i`` starts ``i / rollouts`` of ``start_spread_s`` late."""
    ids = [f"bench_{target.name}_{os.getpid()}_{time.monotonic_ns()}_{i}" for i in range(rollouts)]
    async with httpx.AsyncClient(base_url=target.root, timeout=120, headers=ADMIN) as control:
        keys = await _register(control, ids) if target.gateway else ["unused"] * rollouts
        agents = [
            Agent(_chat_url(target, rid), key, start_spread_s * i / rollouts)
            for i, (rid, key) in enumerate(zip(ids, keys, strict=True))
        ]
        load = Load(target.root, agents, turns, context_tokens, tool_chars, bytes_per_token)
        if clients > 1:
            result = await _drive_clients(load, clients, pids)
        else:
            result = await _drive_here(load, pids)
        if target.gateway:
            if fetch_trajectory:
                result.trajectory = await _fetch_trajectory(control, ids[0], turns)
            for rid in ids:
                (await control.post(f"/v1/rollouts/{rid}/unregister")).raise_for_status()
        return result


async def _burst(root: str, rollouts: int, turns: int, concurrency: int) -> None:
    """Register ``rollouts`` rollouts, run ``turns`` turns each (``concurrency`` at a time),
    and unregister all of them."""
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=root, timeout=120, headers=ADMIN) as control:

        async def one(i: int) -> None:
            rid = f"burst_{os.getpid()}_{i}"
            r = await control.post(f"/v1/rollouts/{rid}/register", json={"model": "scripted"})
            r.raise_for_status()
            key = r.json()["api_key"]
            async with semaphore:
                async with httpx.AsyncClient(
                    base_url=root, timeout=120, headers={"Authorization": f"Bearer {key}"}
                ) as agent:
                    await _rollout(
                        agent, f"/v1/rollouts/{rid}/chat/completions", turns, 1000, [], 200
                    )

        await asyncio.gather(*(one(i) for i in range(rollouts)))
        for i in range(rollouts):
            await control.post(f"/v1/rollouts/burst_{os.getpid()}_{i}/unregister")


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


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    """The command line (``--serve-proxy`` and ``--load-client`` are the child processes')."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40, help="turns per conversation")
    parser.add_argument("--contexts", type=_ints, default=[1000, 32000], help="context tokens")
    parser.add_argument("--concurrency", type=_ints, default=[1, 64], help="concurrent rollouts")
    parser.add_argument("--tool-output-chars", type=int, default=200)
    parser.add_argument("--burst", type=int, default=500, help="rollouts of the RSS burst")
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=3.0,
        help="measure each server's idle CPU this long after the warm-up (0: skip)",
    )
    parser.add_argument("--burst-turns", type=int, default=5)
    parser.add_argument(
        "--min-turns", type=int, default=640, help="turns measured per cell at least (rounds)"
    )
    parser.add_argument(
        "--gateway-option",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `serve` argument, e.g. --gateway-option=--loop=asyncio (repeatable)",
    )
    parser.add_argument(
        "--compare-source",
        metavar="DIR",
        help="also run a gateway from this source tree (a checkout of another version) as 'base'",
    )
    parser.add_argument(
        "--model-latency-ms",
        type=float,
        default=0.0,
        help="the scripted model's time per completion (a sleep, no CPU); default 0",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=1,
        help="load-generator processes per cell (1: this process's event loop)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="start every rollout of a cell at once (default: spread over one model latency)",
    )
    parser.add_argument(
        "--stack-floor",
        action="store_true",
        help="also run the gateway's HTTP stack alone ('stack') and with the JSON work of a "
        "turn ('json') as paths",
    )
    _add_child_options(parser)
    return parser


def _add_child_options(parser: argparse.ArgumentParser) -> None:
    """The hidden options that start this script as one of its own child processes."""
    parser.add_argument(
        "--serve-proxy", nargs="+", metavar="PORT UPSTREAM [LOOP]", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--serve-stack-floor", nargs=3, metavar=("PORT", "UPSTREAM", "JSON"),
        help=argparse.SUPPRESS,
    )  # fmt: skip
    parser.add_argument("--load-client", action="store_true", help=argparse.SUPPRESS)


def _run_child(args: argparse.Namespace) -> bool:
    """Run the child process ``args`` asks for (a proxy, a floor server, a load client);
    whether it was one."""
    if args.serve_proxy:
        run_proxy(int(args.serve_proxy[0]), *args.serve_proxy[1:])
    elif args.serve_stack_floor:
        port, upstream, json_work = args.serve_stack_floor
        run_stack_floor(int(port), upstream, json_work == "1")
    elif args.load_client:
        asyncio.run(_serve_as_client())
    else:
        return False
    return True


def _start_servers(
    stack: contextlib.ExitStack, args: argparse.Namespace
) -> tuple[list[Target], dict[str, int]]:
    """Start the scripted model, the gateway, the proxy (and the base gateway and the
    floor servers when asked) in ``stack``: the targets measured and every pid by name."""
    model_port, proxy_port = _free_port(), _free_port()
    model_root = f"http://127.0.0.1:{model_port}"
    cli = [sys.executable, "-m", "rollout_gateway.cli"]
    max_rollouts = str(max(10_000, args.burst * 2))
    serve_args = ["--max-rollouts", max_rollouts, "--log-level", "warning", *args.gateway_option]
    admin_env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    pids = {
        "model": stack.enter_context(_process(
            [*cli, "scripted-model", "--port", str(model_port), "--log-level", "warning",
             "--latency-ms", str(args.model_latency_ms)],
            f"{model_root}/v1/models",
        )),
    }  # fmt: skip

    def gateway(name: str, source: str | None) -> Target:
        port = _free_port()
        root = f"http://127.0.0.1:{port}"
        pids[name] = stack.enter_context(_process(
            [*cli, "serve", "--upstream", f"{model_root}/v1", "--port", str(port), *serve_args],
            f"{root}/health",
            env=admin_env if source is None else {**admin_env, "PYTHONPATH": source},
            cwd=source,  # `python -m` puts the working directory first on sys.path
        ))  # fmt: skip
        return Target(name, root, pids[name], gateway=True)

    measured = gateway("gateway", None)
    proxy_root = f"http://127.0.0.1:{proxy_port}"
    pids["proxy"] = stack.enter_context(_process(
        [sys.executable, __file__, "--serve-proxy", str(proxy_port), model_root],
        f"{proxy_root}/v1/models",
    ))  # fmt: skip
    targets = [Target("direct", model_root, None), Target("proxy", proxy_root, pids["proxy"])]
    targets.append(measured)
    if args.compare_source:
        targets.append(gateway("base", os.path.abspath(args.compare_source)))
    if args.stack_floor:
        targets += _start_stack_floor(stack, model_root, pids)
    return targets, pids


@dataclass
class Measured:
    """What one run of the benchmark measured."""

    results: dict[tuple[int, int, str], RunResult]
    idle_ms: dict[str, float]
    #: The gateway's RSS after warm-up, after the cells, after the burst (bytes).
    rss: tuple[int, int, int]


def _measure(args: argparse.Namespace) -> Measured:
    """Start every server, warm each path up, measure the cells, the idle CPU and the
    burst; stop the servers."""
    with contextlib.ExitStack() as stack:
        targets, pids = _start_servers(stack, args)
        gateway_pid = pids["gateway"]
        for t in targets:  # warm up every path
            asyncio.run(
                _one_round(t, pids, rollouts=4, turns=3, context_tokens=1000, tool_chars=50)
            )
        rss_start = _proc_stat(gateway_pid)[1]
        idle_ms = _idle_cpu_ms_per_s(pids, args.idle_seconds)
        results = _measure_cells(args, targets, pids)
        rss_before_burst = _proc_stat(gateway_pid)[1]
        gateway_root = next(t.root for t in targets if t.name == "gateway")
        asyncio.run(_burst(gateway_root, args.burst, args.burst_turns, 64))
        time.sleep(1.0)
        rss_after_burst = _proc_stat(gateway_pid)[1]
    return Measured(results, idle_ms, (rss_start, rss_before_burst, rss_after_burst))


def main() -> None:
    """Run the benchmark (or one of its child processes) and print its figures."""
    parser = _parser()
    args = parser.parse_args()
    if _run_child(args):
        return
    if args.clients < 1 or args.model_latency_ms < 0:
        parser.error("--clients must be at least 1 and --model-latency-ms at least 0")
    load_start = os.getloadavg()[0]
    measured = _measure(args)
    print(
        f"turns per conversation: {args.turns}; tool output {args.tool_output_chars} chars; "
        f"host load {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end "
        f"on {os.cpu_count()} CPUs; gateway options: {' '.join(args.gateway_option) or '-'}"
    )
    spread = "all at once" if args.lockstep or not args.model_latency_ms else "spread over it"
    print(
        f"model latency {args.model_latency_ms:g} ms per completion (rollouts of a cell start "
        f"{spread}); load generator: {args.clients} process(es) per cell"
    )
    if args.compare_source:
        print(f"base: a second gateway from {args.compare_source}")
    _report(args, measured)


def _report(args: argparse.Namespace, measured: Measured) -> None:
    """Print the cells, the ratios, the trajectory and storage figures, RSS and idle CPU,
    and the targets."""
    results = measured.results
    cpu_per_turn = _print_cells(results)
    _print_ratios(args, cpu_per_turn)
    for context in args.contexts:
        res = results[(context, args.concurrency[0], "gateway")]
        if res.trajectory is not None:
            full_s, full_b, delta_s, delta_b = res.trajectory
            print(
                f"\ntrajectory {args.turns} turns x {context} tokens: table form "
                f"{full_s * 1000:.1f} ms {full_b / 1e6:.2f} MB; delta form "
                f"{delta_s * 1000:.1f} ms {delta_b / 1e6:.2f} MB"
            )
    stored, unique, logical = storage_per_token()
    print(
        f"token storage, {unique}-token trajectory ({logical} tokens over its steps): "
        f"{stored / unique:.2f} bytes per stored (unique) token"
    )
    rss_start, rss_before_burst, rss_after_burst = measured.rss
    print(
        f"gateway RSS: {rss_start / 1e6:.1f} MB after warm-up, {rss_before_burst / 1e6:.1f} MB "
        f"after the runs, {rss_after_burst / 1e6:.1f} MB after {args.burst} rollouts x "
        f"{args.burst_turns} turns were registered, run and unregistered"
    )
    if measured.idle_ms:
        shown = ", ".join(f"{name} {ms:.3f}" for name, ms in measured.idle_ms.items())
        print(f"idle CPU per second over {args.idle_seconds:g} s, ms: {shown}")
    mean_direct = statistics.mean(
        results[(args.contexts[0], args.concurrency[0], "direct")].latencies_s
    )
    print(f"(direct mean latency at {args.contexts[0]} tokens: {mean_direct * 1000:.2f} ms)")
    _print_targets(args, results, cpu_per_turn, stored / unique, rss_start, rss_after_burst)


def _start_stack_floor(
    stack: contextlib.ExitStack, model_root: str, pids: dict[str, int]
) -> list[Target]:
    """Start the ``stack`` and ``json`` paths (see ``--stack-floor``) in ``stack``; their
    pids go into ``pids``."""
    targets = []
    for name, json_work in (("stack", "0"), ("json", "1")):
        port = _free_port()
        root = f"http://127.0.0.1:{port}"
        pids[name] = stack.enter_context(
            _process(
                [sys.executable, __file__, "--serve-stack-floor", str(port), model_root,
                 json_work],
                f"{root}/v1/models",
            )
        )  # fmt: skip
        targets.append(Target(name, root, pids[name]))
    return targets


def _measure_cells(
    args: argparse.Namespace, targets: list[Target], pids: dict[str, int]
) -> dict[tuple[int, int, str], RunResult]:
    """Every cell (context x concurrency) on every path: (context, concurrency, path) ->
    its figures over at least ``--min-turns`` turns. The paths take turns round by round,
    so a drift of the shared machine over a cell's seconds weighs on every path alike."""
    results: dict[tuple[int, int, str], RunResult] = {}
    spread_s = 0.0 if args.lockstep else args.model_latency_ms / 1000
    for context in args.contexts:
        for conc in args.concurrency:
            for i in range(rounds_for(args.min_turns, conc, args.turns)):
                for t in targets:
                    res = asyncio.run(
                        _one_round(
                            t, pids, rollouts=conc, turns=args.turns, context_tokens=context,
                            tool_chars=args.tool_output_chars,
                            fetch_trajectory=conc == args.concurrency[0] and i == 0,
                            clients=args.clients, start_spread_s=spread_s,
                        )
                    )  # fmt: skip
                    cell = results.setdefault((context, conc, t.name), RunResult([], 0.0, {}))
                    merge_run(cell, res)
    return results


def _print_cells(
    results: dict[tuple[int, int, str], RunResult],
) -> dict[tuple[int, int, str], float]:
    """One line per cell and path; returns the hop's CPU ms per turn of each."""
    print(
        f"{'context':>8}{'conc':>6}  {'path':<8}{'p50 ms':>9}{'p99 ms':>9}{'+p50':>8}{'+p99':>8}"
        f"{'hop CPU ms/turn':>17}{'model CPU ms/turn':>19}{'gen CPU ms/turn':>17}{'gen cores':>11}"
    )
    cpu_per_turn: dict[tuple[int, int, str], float] = {}
    for (context, conc, name), res in results.items():
        n = len(res.latencies_s)
        direct = results[(context, conc, "direct")]
        hop = res.cpu_s.get(name, 0.0) * 1000 / n if name != "direct" else 0.0
        cpu_per_turn[(context, conc, name)] = hop
        print(
            f"{context:>8}{conc:>6}  {name:<8}{res.pct(0.5):9.2f}{res.pct(0.99):9.2f}"
            f"{res.pct(0.5) - direct.pct(0.5):8.2f}{res.pct(0.99) - direct.pct(0.99):8.2f}"
            f"{hop:17.3f}{res.cpu_s['model'] * 1000 / n:19.3f}"
            f"{res.loadgen_cpu_s * 1000 / n:17.3f}{res.loadgen_cpu_s / res.wall_s:11.2f}"
        )
    return cpu_per_turn


def _print_ratios(
    args: argparse.Namespace, cpu_per_turn: dict[tuple[int, int, str], float]
) -> None:
    """CPU per turn: gateway/proxy per cell, the gateway's own extra (gateway - proxy), and
    each figure at the largest context against the smallest."""
    print("\nratios (same run):")
    for context in args.contexts:
        for conc in args.concurrency:
            g, p = cpu_per_turn[(context, conc, "gateway")], cpu_per_turn[(context, conc, "proxy")]
            print(
                f"  gateway/proxy CPU per turn at {context} tokens, {conc} rollouts: {g / p:.2f}x"
                f"; gateway - proxy: {g - p:.3f} ms"
            )
            if args.compare_source:
                b = cpu_per_turn[(context, conc, "base")]
                print(
                    f"  base/proxy {b / p:.2f}x; gateway/base CPU per turn at {context} tokens, "
                    f"{conc} rollouts: {g / b:.2f}x"
                )
            if args.stack_floor:
                st, js = (
                    cpu_per_turn[(context, conc, "stack")],
                    cpu_per_turn[(context, conc, "json")],
                )
                print(
                    f"  stack/proxy {st / p:.2f}x, json/proxy {js / p:.2f}x; gateway/json "
                    f"{g / js:.2f}x (the gateway's own work per turn: {g - js:.3f} ms)"
                )
    if len(args.contexts) < 2:
        return
    lo, hi = args.contexts[0], args.contexts[-1]
    for conc in args.concurrency:
        at = {size: _cell_cpu(cpu_per_turn, size, conc) for size in (lo, hi)}
        print(
            f"  CPU per turn {hi} vs {lo} tokens, {conc} rollouts: gateway "
            f"{_ratio(at[hi]['gateway'], at[lo]['gateway'])}, proxy "
            f"{_ratio(at[hi]['proxy'], at[lo]['proxy'])}, gateway - proxy "
            f"{_ratio(at[hi]['extra'], at[lo]['extra'])}"
            f" ({at[lo]['extra']:.3f} -> {at[hi]['extra']:.3f} ms)"
        )
        if args.compare_source:
            print(
                f"  base CPU per turn {hi} vs {lo} tokens, {conc} rollouts: "
                f"{_ratio(at[hi]['base'], at[lo]['base'])}"
            )


def _cell_cpu(
    cpu_per_turn: dict[tuple[int, int, str], float], context: int, conc: int
) -> dict[str, float]:
    """CPU ms per turn of every hop in one cell, plus ``extra``: gateway minus proxy."""
    cell = {name: v for (c, n, name), v in cpu_per_turn.items() if (c, n) == (context, conc)}
    return {**cell, "extra": cell["gateway"] - cell["proxy"]}


def _ratio(num: float, den: float) -> str:
    """``num / den`` as ``1.23x``; ``n/a`` when the denominator is not positive (e.g. the
    gateway's extra CPU within the noise of the proxy's)."""
    return f"{num / den:.2f}x" if den > 0 else "n/a"


#: A target's row: what, the target, the figure measured, whether it is met.
TargetRow = tuple[str, str, str, bool]


def _cpu_rows(
    args: argparse.Namespace, cpu_per_turn: dict[tuple[int, int, str], float]
) -> list[TargetRow]:
    """CPU per turn against the proxy's, and its growth with the context."""
    rows: list[TargetRow] = []
    lo, hi = args.contexts[0], args.contexts[-1]
    for conc in args.concurrency:
        ratio = cpu_per_turn[(lo, conc, "gateway")] / cpu_per_turn[(lo, conc, "proxy")]
        name = f"CPU/turn gateway/proxy, {lo} tok, {conc} rollouts"
        rows.append((name, "<= 1.5x", f"{ratio:.2f}x", ratio <= 1.5))
    if hi != lo:
        for conc in args.concurrency:
            flat = cpu_per_turn[(hi, conc, "gateway")] / cpu_per_turn[(lo, conc, "gateway")]
            name = f"CPU/turn gateway {hi} vs {lo} tok, {conc} rollouts"
            rows.append((name, "<= 1.2x", f"{flat:.2f}x", flat <= 1.2))
    return rows


def _latency_rows(
    args: argparse.Namespace, results: dict[tuple[int, int, str], RunResult]
) -> list[TargetRow]:
    """The latency the gateway adds to a turn over the model's own (the proxy's beside)."""
    rows: list[TargetRow] = []
    lo = args.contexts[0]
    for conc in args.concurrency:
        gateway, direct = results[(lo, conc, "gateway")], results[(lo, conc, "direct")]
        proxy = results[(lo, conc, "proxy")]
        for q, label, bound in ((0.5, "p50", 1.0), (0.99, "p99", 5.0)):
            added = gateway.pct(q) - direct.pct(q)
            by_proxy = proxy.pct(q) - direct.pct(q)
            rows.append(
                (
                    f"added latency {label}, {lo} tok, {conc} rollouts",
                    f"< {bound:g} ms",
                    f"{added:.2f} ms (proxy {by_proxy:.2f})",
                    added < bound,
                )
            )
    return rows


def _print_targets(
    args: argparse.Namespace,
    results: dict[tuple[int, int, str], RunResult],
    cpu_per_turn: dict[tuple[int, int, str], float],
    bytes_per_token: float,
    rss_start: int,
    rss_after_burst: int,
) -> None:
    """The issue's targets side by side with this run's figures."""
    rows = [*_cpu_rows(args, cpu_per_turn), *_latency_rows(args, results)]
    hi = args.contexts[-1]
    fetch = results[(hi, args.concurrency[0], "gateway")].trajectory
    if fetch is not None:
        full_s, _, delta_s, _ = fetch
        rows.append(
            (
                f"trajectory fetch {args.turns} x {hi} tok (delta / table)",
                "< 60 ms",
                f"{delta_s * 1000:.1f} / {full_s * 1000:.1f} ms",
                delta_s < 0.060,
            )
        )
    rows.append(("bytes per stored token", "<= 8", f"{bytes_per_token:.2f}", bytes_per_token <= 8))
    grown = rss_after_burst / rss_start
    rows.append(
        (
            f"RSS after a {args.burst}-rollout burst / after warm-up",
            "near 1x",
            f"{grown:.2f}x ({rss_after_burst / 1e6:.0f} / {rss_start / 1e6:.0f} MB)",
            grown <= 1.5,
        )
    )
    width = max(len(r[0]) for r in rows)
    print(f"\ntargets (issue 11), this run:\n  {'':<{width}}  {'target':<10}{'measured':<26}met")
    for name, target, measured, met in rows:
        print(f"  {name:<{width}}  {target:<10}{measured:<26}{'yes' if met else 'NO'}")


if __name__ == "__main__":
    main()
