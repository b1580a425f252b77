"""Instructions per turn of each server process, counted by valgrind (any machine).

What a process executes is the same on any machine, however loaded.

Wall-clock CPU on a shared machine cannot settle a 5% question; the instructions a
process executes can. Every server process of a setup runs under valgrind's cachegrind
(instructions only, no cache simulation); the scripted model and the load generator run
natively (not counted). The same conversation is driven through each setup, and each
process's count is read when it exits.

**Marginal instructions per turn.** For each cell (context size x chat or streamed) and
setup, two fresh copies of the setup's processes run at once: through one, ``--rollouts``
rollouts (one after another) of ``N`` turns (``--turns``); through the other, the same
rollouts of ``2N`` turns. ``(count(2N) - count(N)) / (rollouts x N)`` is then what a turn
costs each process: start-up, shutdown and what a rollout costs once (register,
unregister) cancel. The conversation is a tool-calling one of ``2N`` turns (the first
``N`` are the same bytes in both); its system prompt is padded so that the prompts of the
measured turns (``N+1 .. 2N``) average the cell's context size in the scripted model's
tokens (1 byte each). Python processes run with ``PYTHONHASHSEED=0``, on bytecode
compiled beforehand.

**Timers.** A process also works on timers, in proportion to the wall-clock time it
lives: the gateway's server formats its ``Date`` header once a second (some 90,000
instructions under valgrind), Redis runs its cron ten times a second. So every process of
a pair lives as long from the moment it was ready to its stop (the longer drive plus
6 s): that work weighs alike in both and cancels. What remains is the machine's timing in
the I/O itself (an answer read in two pieces or three): a few tens of thousands of
instructions per turn at most, less as ``--rollouts`` grows.

**The machine's load.** A gateway probes its model once at start-up with 2 s to answer;
under valgrind on a loaded machine the probe timed out, and the gateway streamed nothing
upstream until a turn probed again 30 s later (a turn the timing picked). The counted
gateways run through :data:`PATIENT_PROBE` (the probe gets 60 s; one that still failed is
started again). The model sends a streamed answer in one write (see :func:`serve_model`).
With both, runs at load 12-47 agreed within 0.4% (streamed) and 1.3% (chat).

Setups (``--setups``; all by default):

* ``memory``: ``rollout-gateway serve`` (state in memory);
* ``sqlite``: ``serve --state-dir DIR --state-sync normal``;
* ``redis-3``: three ``serve --redis`` gateways behind HAProxy (round robin: every turn
  at the next gateway), with ``redis-server`` (append-only file, ``everysec``): each of
  the five processes counted (HAProxy's health checks every hour, not every 500 ms: a
  check is a request to a gateway, and their number would follow the wall clock);
* ``proxy``: a plain aiohttp pass-through proxy (``gateway_overhead.py``'s), on uvloop
  (the gateway's loop: on asyncio's, the passes of its loop a turn takes follow the
  machine's timing, and its counts spread by 4% run to run);
* ``base``: with ``--compare-source DIR``, a memory gateway from that checkout.

Prints, per cell, each process's marginal instructions per turn, then the ratios the
issue's targets name (each side by side with its baseline from the same run): the context
slope (largest context against the smallest), memory against ``base``, SQLite against
memory, Redis-3 (three gateways and redis-server) against memory, gateway against proxy.
``--repeat 2`` runs everything twice and prints how far the two runs' figures differ.
``--json FILE`` writes the figures. ::

    python benchmarks/instructions.py --quick                  # memory, proxy; 1k, 32k
    python benchmarks/instructions.py --compare-source DIR     # every setup, every cell
    python benchmarks/instructions.py --quick --setups memory --modes chat --repeat 2

Needs ``valgrind`` (and ``redis-server``, ``haproxy`` and the ``redis`` extra for
``redis-3``). Under valgrind a process runs some 50 times slower: a set of processes
starts in 10-15 s of CPU each (imports), a turn takes tens of milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import callgrind_layers
import httpx
from callgrind_layers import SEPARATE_CALLERS
from gateway_overhead import (
    ADMIN,
    ADMIN_TOKEN,
    _first_messages,
    _free_port,
    _process,
    _register,
    _tool_output,
)

from rollout_gateway import child_processes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
from support.local_cluster import GatewayGroup, RedisServer, haproxy_config  # noqa: E402

CLI = [sys.executable, "-m", "rollout_gateway.cli"]
#: Dict and set order, hence the work, the same in every process.
COUNTED_ENV = {"PYTHONHASHSEED": "0", "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
#: ``python -m rollout_gateway.cli``, its start-up probe of the model given 60 s instead
#: of 2 (the default of ``probe_engine``'s timeout, in this checkout or an earlier one).
#: Under valgrind on a loaded machine (load 18 on 2 cores) every probe took longer than
#: 2 s: a gateway then knows no engine until a turn probes again 30 s later, so its turns
#: are not streamed upstream until a turn the machine's timing picks (two runs' streamed
#: counts differed by 30-200%). Only the probe's patience changes, not what it does.
#: Where the checkout has the periodic health probe (``--probe-interval``, every second a
#: ``GET /models`` upstream and a store check), it runs once an hour instead, and given
#: 60 s instead of 2: it costs per second, not per turn, and the 2N-turn process lives
#: seconds longer than the N-turn one (more under load), so those seconds' probes landed
#: in the per-turn figure (the guard's 1k cell read 1.39 then 1.57 M back to back on a
#: quiet machine); patient, because ``/health`` answers from the start-up probe until
#: the next one, an hour later (under callgrind at load 20 it took over 2 s).
PATIENT_PROBE = """
import importlib, runpy
for name in ("rollout_gateway.server.engines.probe", "rollout_gateway.server.engines"):
    try:
        importlib.import_module(name).probe_engine.__defaults__ = (60.0,)
        break
    except (ImportError, AttributeError):
        pass
import sys
try:
    health = importlib.import_module("rollout_gateway.server.ops.health")
    health.HealthMonitor.__init__.__kwdefaults__["timeout_s"] = 60.0
    if sys.argv[1:2] == ["serve"]:
        sys.argv[2:2] = ["--probe-interval", "3600"]
except (ImportError, AttributeError, KeyError, TypeError):
    pass
runpy.run_module("rollout_gateway.cli", run_name="__main__", alter_sys=True)
"""
#: Starts of a gateway whose probe of the model timed out (see Server._probe_failed).
PROBE_ATTEMPTS = 4
#: A process under valgrind starts and stops in tens of seconds on a loaded machine.
START_TIMEOUT_S = 600.0
SETUPS = ("memory", "sqlite", "redis-3", "proxy", "base")
MODES = ("chat", "stream")


@dataclass(frozen=True)
class Tools:
    """How the counted processes run: under cachegrind (counts), or callgrind (profiles,
    ``--profile``), and which interpreter runs the Python servers."""

    python: tuple[str, ...] = (sys.executable,)
    profile: bool = False

    def counted(self, cmd: list[str], out: Path) -> list[str]:
        """``cmd`` under valgrind, its counts written to ``out`` when it exits."""
        if self.profile:
            tool = ["--tool=callgrind", f"--separate-callers={SEPARATE_CALLERS}",
                    f"--callgrind-out-file={out}"]  # fmt: skip
        else:
            tool = ["--tool=cachegrind", "--cache-sim=no", "--branch-sim=no",
                    f"--cachegrind-out-file={out}"]  # fmt: skip
        return ["valgrind", "-q", *tool, *cmd]

    @property
    def cli(self) -> list[str]:
        """``rollout-gateway`` as the counted servers run it (:data:`PATIENT_PROBE`)."""
        return [*self.python, "-c", PATIENT_PROBE]

    def env(self, source: str | None = None) -> dict[str, str]:
        """A counted Python server's environment: ``source`` (another checkout) or this
        one first on its path (another interpreter has not installed this package)."""
        first = source or str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (first, os.environ.get("PYTHONPATH")) if p)
        return {**COUNTED_ENV, "PYTHONPATH": path}


def instructions(out: Path) -> int:
    """The instructions a process executed (its cachegrind file's ``summary:`` line)."""
    for line in out.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise ValueError(f"{out}: no summary line")


# -- the model -----------------------------------------------------------------------------


def serve_model(port: int) -> None:
    """The scripted model, its model card saying vLLM (``owned_by``): the gateway then
    streams from it as from vLLM (the first chunk carrying the prompt's ids), what a
    streamed turn costs in a deployment. Not counted.

    A streamed answer is sent in one write: chunk by chunk, how many of them a server
    reads at once follows the machine's timing (its count of the same streamed turn
    spread by 35% between two runs on a loaded machine); in one write every chunk is
    still parsed, relayed and recorded, and what the reads cost is the same every run."""
    import orjson
    import uvicorn

    from rollout_gateway.scripted import create_scripted_model_app

    app = create_scripted_model_app()
    card = {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "vllm"}]}

    async def as_vllm(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            head = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": orjson.dumps(card)})
            return
        await app(scope, receive, _one_write(send))

    uvicorn.run(as_vllm, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _one_write(send: Any) -> Any:
    """``send``, with a response body's parts held back and sent as one."""
    parts: list[bytes] = []

    async def coalesced(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            await send(message)
            return
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            await send({"type": "http.response.body", "body": b"".join(parts)})

    return coalesced


# -- the conversation ---------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One context size in one mode."""

    context: int
    mode: str

    @property
    def label(self) -> str:
        return f"{self.context // 1000}k {self.mode}"


@dataclass
class Conversation:
    """A cell's conversation: its first messages (a script of ``2N`` turns) and the
    tool output each turn adds."""

    messages: list[dict[str, Any]]
    tool_chars: int
    stream: bool

    def body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        # max_tokens: the gateway before issue 30 (2f93dd4) sent its remaining budget
        # (4,000,000) when the agent sent none, which the scripted model (as vLLM) refuses.
        body = {"model": "scripted", "messages": messages, "return_token_ids": True,
                "logprobs": True, "max_tokens": 512}  # fmt: skip
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


async def converse(
    client: httpx.AsyncClient, url: str, conversation: Conversation, turns: int
) -> list[int]:
    """Drive ``turns`` turns of ``conversation``; the prompt tokens of each."""
    messages = [dict(m) for m in conversation.messages]
    prompts = []
    for turn in range(turns):
        body = conversation.body(messages)
        if conversation.stream:
            message, usage = await _streamed(client, url, body)
        else:
            r = await client.post(url, json=body)
            r.raise_for_status()
            answer = r.json()
            message, usage = answer["choices"][0]["message"], answer["usage"]
        prompts.append(usage["prompt_tokens"])
        messages.append({k: v for k, v in message.items() if v is not None})
        for call in message.get("tool_calls") or ():
            output = _tool_output(turn, conversation.tool_chars, 1, url)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    return prompts


async def _streamed(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A streamed answer's message (its deltas joined) and usage."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    into = calls.setdefault(call["index"], {"type": "function", "function": {}})
                    into["id"] = call.get("id") or into.get("id")
                    function = call.get("function") or {}
                    into["function"]["name"] = function.get("name") or into["function"].get("name")
                    into["function"]["arguments"] = into["function"].get("arguments", "") + (
                        function.get("arguments") or ""
                    )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, usage


def conversations(
    model_root: str, cells: list[Cell], turns: int, tool_chars: int
) -> dict[Cell, tuple[Conversation, float]]:
    """Each cell's conversation, padded so that turns ``N+1 .. 2N`` average the cell's
    context (checked against the model directly), with their mean prompt tokens."""

    async def measured(conversation: Conversation) -> list[int]:
        async with httpx.AsyncClient(base_url=model_root, timeout=120) as client:
            return await converse(client, "/v1/chat/completions", conversation, 2 * turns)

    out = {}
    for cell in cells:
        stream = cell.mode == "stream"
        first = Conversation(_first_messages(2 * turns, cell.context), tool_chars, stream)
        prompts = asyncio.run(measured(first))
        growth = statistics.fmean(prompts[turns:]) - prompts[0]
        padded = max(1, cell.context - round(growth))
        conversation = Conversation(_first_messages(2 * turns, padded), tool_chars, stream)
        prompts = asyncio.run(measured(conversation))
        out[cell] = (conversation, statistics.fmean(prompts[turns:]))
    return out


# -- the setups ------------------------------------------------------------------------------


class Server:
    """One counted process: started, ready once ``health`` answers 200 (or, without it,
    once ``port`` takes connections), stopped with SIGTERM (valgrind writes its file as
    the process exits)."""

    def __init__(
        self,
        cmd: list[str],
        log: Path,
        *,
        health: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.health, self.port = health, port
        self.log = log
        self._start = (cmd, {**os.environ, **(env or {})}, cwd)
        self.proc = self._spawn()
        #: When it was seen ready (``time.monotonic``).
        self.ready = 0.0

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd, env, cwd = self._start
        with open(self.log, "ab") as out:
            # Its own group, dead with this process (set before valgrind's exec).
            return child_processes.spawn(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
            )

    def wait_ready(self) -> None:
        """Wait until it answers; a gateway whose start-up probe of the model failed is
        started again (see :meth:`_probe_failed`)."""
        for attempt in range(PROBE_ATTEMPTS):
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self._answers():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = self.log.read_text()[-2000:]
                    raise RuntimeError(f"{self.log.stem} did not start: {log}")
                time.sleep(0.05)
            if not self._probe_failed() or attempt == PROBE_ATTEMPTS - 1:
                break
            print(f"  ({self.log.stem}: its probe of the model timed out; started again)")
            self.stop()
            self.proc = self._spawn()
        self.ready = time.monotonic()

    def _probe_failed(self) -> bool:
        """Whether a gateway's start-up probe of the model did not answer in time (2 s:
        under valgrind on a loaded machine it may not). Such a gateway knows no engine
        until it probes again on a turn 30 s later: its turns are not streamed upstream
        until then, and which turn that is follows the machine's timing (two runs'
        streamed counts differed by 30-200% so)."""
        if self.health is None or not self.health.endswith("/health"):
            return False
        with contextlib.suppress(OSError, httpx.HTTPError, ValueError):
            answer = httpx.get(self.health, headers=ADMIN, timeout=5).json()
            upstreams = answer.get("upstreams") or []
            return any(u.get("engine") not in ("vllm", None) for u in upstreams)
        return False

    def _answers(self) -> bool:
        with contextlib.suppress(OSError, httpx.HTTPError):
            if self.health is not None:
                return httpx.get(self.health, headers=ADMIN, timeout=5).status_code == 200
            with socket.create_connection(("127.0.0.1", self.port or 0), 1):
                return True
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Started:
    """A setup's processes, running: where an agent sends its turns, and each counted
    process with its valgrind file (read once it exited)."""

    root: str
    gateway: bool
    servers: dict[str, Server] = field(default_factory=dict)
    outs: dict[str, Path] = field(default_factory=dict)

    def add(self, name: str, server: Server, out: Path) -> None:
        self.servers[name], self.outs[name] = server, out

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def _serve(tools: Tools, model_root: str, port: int, *extra: str) -> list[str]:
    return [*tools.cli, "serve", "--upstream", f"{model_root}/v1", "--port", str(port),
            "--log-level", "warning", *extra]  # fmt: skip


def _gateway(
    tools: Tools, directory: Path, name: str, cmd: list[str], port: int, cwd: str | None = None
) -> tuple[Server, Path]:
    # cwd: another checkout's gateway (``python -m`` puts the working directory first).
    out = directory / f"{name}.out"
    server = Server(
        tools.counted(cmd, out), directory / f"{name}.log", env=tools.env(cwd), cwd=cwd,
        health=f"http://127.0.0.1:{port}/health",
    )  # fmt: skip
    return server, out


def start_setup(
    name: str, directory: Path, model_root: str, source: str | None, tools: Tools
) -> Started:
    """Setup ``name``'s processes, started and ready (their files in ``directory``)."""
    directory.mkdir(parents=True)
    port = _free_port()
    started = Started(f"http://127.0.0.1:{port}", name != "proxy")
    try:
        if name in ("memory", "sqlite", "base"):
            extra = ["--state-dir", str(directory / "state"), "--state-sync", "normal"]
            cmd = _serve(tools, model_root, port, *(extra if name == "sqlite" else ()))
            started.add("gateway", *_gateway(tools, directory, "gateway", cmd, port,
                                             cwd=source if name == "base" else None))  # fmt: skip
        elif name == "proxy":
            out = directory / "proxy.out"
            script = str(Path(__file__).with_name("gateway_overhead.py"))
            cmd = [*tools.python, script, "--serve-proxy", str(port), model_root, "uvloop"]
            server = Server(tools.counted(cmd, out), directory / "proxy.log", env=tools.env(),
                            health=f"{started.root}/v1/models")  # fmt: skip
            started.add("proxy", server, out)
        else:
            _start_redis_3(started, tools, directory, model_root, port)
        for server in started.servers.values():
            if not server.ready:
                server.wait_ready()
    except BaseException:
        started.stop()
        raise
    return started


#: Held while a setup's PATH leads to its counted redis-server wrapper.
_PATH_LOCK = threading.Lock()


def _start_redis_3(
    started: Started, tools: Tools, directory: Path, model_root: str, port: int
) -> None:
    """redis-server, three gateways on it, HAProxy in front (round robin)."""
    # RedisServer runs the redis-server it finds on PATH: a wrapper that runs it counted.
    # PATH is the process's, and the pair's two setups start at once, in threads: each
    # must find the real server and then its own wrapper (unlocked, one setup's wrapper
    # ran the other's, and both redis-servers were counted into one file).
    with _PATH_LOCK:
        real = shutil.which("redis-server")
        if real is None:
            raise RuntimeError("redis-3 needs redis-server (Debian: apt-get install redis-server)")
        out = directory / "redis.out"
        (directory / "bin").mkdir()
        wrapper = directory / "bin" / "redis-server"
        wrapper.write_text(f'#!/bin/sh\nexec {" ".join(tools.counted([real], out))} "$@"\n')
        wrapper.chmod(0o755)
        path = os.environ["PATH"]
        os.environ["PATH"] = f"{directory / 'bin'}{os.pathsep}{path}"
        try:
            redis = RedisServer(directory / "redis", fsync="everysec").start()
        finally:
            os.environ["PATH"] = path
    started.add("redis", _Started(redis), out)
    group = GatewayGroup(
        redis.url, f"{model_root}/v1", 3, directory, admin_token=ADMIN_TOKEN,
        extra_args=["--max-rollouts", "1000"],
    )  # fmt: skip
    for index, gateway_port in enumerate(group.ports):
        cmd = [*tools.cli, *group.command(index)[3:]]  # the servers' interpreter
        started.add(f"gw{index}", *_gateway(tools, directory, f"gw{index}", cmd, gateway_port))
    for server in started.servers.values():
        if not server.ready:
            server.wait_ready()
    # Health checks every hour, not every 500 ms: each is a request to a gateway.
    config = directory / "haproxy.cfg"
    config.write_text(haproxy_config(port, group.ports).replace("inter 500ms", "inter 1h"))
    out = directory / "haproxy.out"
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    cmd = tools.counted([haproxy, "-db", "-f", str(config)], out)
    started.add("haproxy", Server(cmd, directory / "haproxy.log", port=port), out)


class _Started(Server):
    """A :class:`support.local_cluster.RedisServer` (started, ready) as a
    :class:`Server`."""

    def __init__(self, redis: RedisServer) -> None:  # noqa: D107
        self.redis = redis
        self.ready = time.monotonic()

    def stop(self) -> None:
        # SIGTERM, and time to exit: under valgrind redis-server writes its append-only
        # file and its count in more than RedisServer.stop's 10 s (killed, no count).
        child = self.redis._child
        if child is not None and child.proc is not None and child.proc.poll() is None:
            child.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(START_TIMEOUT_S)
        self.redis.stop()


# -- one pair ----------------------------------------------------------------------------------


async def drive(
    started: Started, conversation: Conversation, turns: int, setup: str, rollouts: int
) -> float:
    """``rollouts`` rollouts of ``conversation``, one after another: each registered,
    ``turns`` turns, unregistered. Every connection is closed at the end, when it
    returns (``time.monotonic``)."""
    async with httpx.AsyncClient(base_url=started.root, timeout=600, headers=ADMIN) as control:
        for rollout in range(rollouts):
            rid = f"instructions_{setup}_{rollout}"
            url, headers = "/v1/chat/completions", {}
            if started.gateway:
                (key,) = await _register(control, [rid])
                url = f"/v1/rollouts/{rid}/chat/completions"
                headers = {"Authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(
                base_url=started.root, timeout=600, headers=headers
            ) as agent:
                await converse(agent, url, conversation, turns)
            if started.gateway:
                (await control.post(f"/v1/rollouts/{rid}/unregister")).raise_for_status()
    return time.monotonic()


def run_pair(
    name: str,
    directory: Path,
    model_root: str,
    args: argparse.Namespace,
    conversation: Conversation,
) -> tuple[dict[str, Path], dict[str, Path]]:
    """Setup ``name`` twice, fresh, at once: ``conversation`` driven for ``N`` turns per
    rollout through one, ``2N`` through the other. Each one's valgrind files.

    Every process of both lives as long from the moment it was ready to its stop: the
    longer drive plus 6 s (an idle keep-alive connection is closed in both, never in one
    only). What a process does on a timer (the gateway's housekeeping once a second,
    Redis's ten times) then weighs alike in both.
    """
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(start_setup, name, directory / part, model_root, args.compare_source,
                        args.tools)
            for part in ("n", "2n")
        ]  # fmt: skip
        pair = [future.result() for future in starting]
    try:

        async def both() -> list[float]:
            return await asyncio.gather(
                *(drive(started, conversation, turns, name, args.rollouts)
                  for started, turns in zip(pair, (args.turns, 2 * args.turns), strict=True))
            )  # fmt: skip

        ends = asyncio.run(both())
        servers = [s for started in pair for s in started.servers.values()]
        lifetime = 6.0 + max(
            end - min(s.ready for s in started.servers.values())
            for started, end in zip(pair, ends, strict=True)
        )
        for server in sorted(servers, key=lambda s: s.ready):
            time.sleep(max(0.0, server.ready + lifetime - time.monotonic()))
            server.stop()
    finally:
        for started in pair:
            started.stop()
    return pair[0].outs, pair[1].outs


# -- figures -----------------------------------------------------------------------------------

#: setup -> process -> cell -> marginal instructions per turn.
Figures = dict[str, dict[str, dict[Cell, float]]]
#: setup -> process -> cell -> layer -> marginal instructions per turn.
Layers = dict[str, dict[str, dict[Cell, dict[str, float]]]]


def measure(
    args: argparse.Namespace,
    directory: Path,
    model_root: str,
    plans: dict[Cell, tuple[Conversation, float]],
) -> tuple[Figures, Layers]:
    """The marginal instructions per turn of every process in every cell (one run), and
    with ``--profile`` their layers. ``--jobs`` pairs run at once."""
    jobs = [(setup, cell) for cell in plans for setup in args.setups]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            (setup, cell): pool.submit(
                run_pair, setup, directory / f"{setup}-{cell.context}-{cell.mode}", model_root,
                args, plans[cell][0],
            )
            for setup, cell in jobs
        }  # fmt: skip
        pairs = {job: future.result() for job, future in futures.items()}
    turns = args.turns * args.rollouts
    figures: Figures = {}
    layers: Layers = {}
    for (setup, cell), (short, long) in pairs.items():
        for process, out in short.items():
            by_cell = figures.setdefault(setup, {}).setdefault(process, {})
            by_cell[cell] = (instructions(long[process]) - instructions(out)) / turns
            if args.profile and process not in ("redis", "haproxy"):
                shares = callgrind_layers.marginal(long[process], out, turns)
                layers.setdefault(setup, {}).setdefault(process, {})[cell] = shares
    return figures, layers


def gateways(figures: Figures, setup: str, cell: Cell) -> float:
    """A setup's instructions per turn that the targets compare: its gateway processes
    (and redis-server for ``redis-3``; not HAProxy, the balancer)."""
    processes = figures[setup]
    return sum(v[cell] for name, v in processes.items() if name != "haproxy")


def print_figures(figures: Figures, plans: dict[Cell, tuple[Conversation, float]]) -> None:
    cells = list(plans)
    print("\nmarginal instructions per turn, millions (measured turns' mean prompt tokens):")
    head = "".join(f"{c.label:>14}" for c in cells)
    print(f"  {'setup':<10}{'process':<10}{head}")
    contexts = "".join(f"{f'({plans[c][1]:.0f})':>14}" for c in cells)
    print(f"  {'':<20}{contexts}")
    for setup, processes in figures.items():
        for process, by_cell in processes.items():
            row = "".join(f"{by_cell[c] / 1e6:14.3f}" for c in cells)
            print(f"  {setup:<10}{process:<10}{row}")
        if len(processes) > 1:
            row = "".join(f"{gateways(figures, setup, c) / 1e6:14.3f}" for c in cells)
            print(f"  {setup:<10}{'counted':<10}{row}   (all but haproxy)")


def print_ratios(args: argparse.Namespace, figures: Figures, cells: list[Cell]) -> None:
    """The targets' ratios, each with its baseline of this run."""
    print("\nratios (same run):")
    modes = sorted({c.mode for c in cells}, key=MODES.index)
    contexts = sorted({c.context for c in cells})
    lo, hi = contexts[0], contexts[-1]
    for mode in modes:
        small, large = Cell(lo, mode), Cell(hi, mode)
        for setup in figures:
            if hi != lo:
                a, b = gateways(figures, setup, small), gateways(figures, setup, large)
                print(f"  {mode:<7}{setup:<9}{hi // 1000}k / {lo // 1000}k: {b / a:.2f}x "
                      f"({a / 1e6:.3f} -> {b / 1e6:.3f} M)")  # fmt: skip
        for num, den, target in (
            ("memory", "base", "<= 1.00x"), ("sqlite", "memory", "<= 1.15x"),
            ("redis-3", "memory", "<= 1.5x"), ("memory", "proxy", "(instructions)"),
        ):  # fmt: skip
            if num not in figures or den not in figures:
                continue
            for context in contexts:
                cell = Cell(context, mode)
                a, b = gateways(figures, num, cell), gateways(figures, den, cell)
                print(f"  {mode:<7}{num}/{den} at {context // 1000}k: {a / b:.2f}x "
                      f"({a / 1e6:.3f} / {b / 1e6:.3f} M)  target {target}")  # fmt: skip


def print_agreement(runs: list[Figures], cells: list[Cell]) -> float:
    """How far the runs' figures differ: the largest relative spread of any counted
    figure (each process, each cell)."""
    worst = 0.0
    print(f"\nagreement of {len(runs)} runs (max - min) / min, per process and cell:")
    for setup, processes in runs[0].items():
        for process in processes:
            spreads = []
            for cell in cells:
                values = [run[setup][process][cell] for run in runs]
                low = min(values)
                spreads.append((max(values) - low) / low if low > 0 else float("inf"))
            worst = max(worst, *spreads)
            shown = "".join(f"{s * 100:13.2f}%" for s in spreads)
            print(f"  {setup:<10}{process:<10}{shown}")
    print(f"  largest: {worst * 100:.2f}%")
    return worst


def print_layers(layers: Layers, cells: list[Cell]) -> None:
    """Each profiled process's marginal instructions per turn by layer, per cell."""
    for setup, processes in layers.items():
        for process, by_cell in processes.items():
            names = sorted({n for shares in by_cell.values() for n in shares},
                           key=lambda n: -max(s.get(n, 0.0) for s in by_cell.values()))  # fmt: skip
            print(f"\n{setup} {process}: marginal instructions per turn by layer, M (share)")
            print(f"  {'layer':<16}" + "".join(f"{c.label:>20}" for c in cells))
            for name in names:
                row = ""
                for cell in cells:
                    value, total = by_cell[cell].get(name, 0.0), sum(by_cell[cell].values())
                    row += f"{value / 1e6:12.3f} ({value / total * 100:4.1f}%)"
                print(f"  {name:<16}{row}")
            totals = "".join(f"{sum(by_cell[c].values()) / 1e6:12.3f}{'':8}" for c in cells)
            print(f"  {'total':<16}{totals}")


def _precompile(tools: Tools, source: str | None) -> None:
    """Compile the packages' bytecode once, with the servers' interpreter, so that no
    counted process compiles it (the first would pay what later ones do not)."""
    import rollout_gateway

    for tree in (Path(rollout_gateway.__file__).parent, Path(source or "") / "rollout_gateway"):
        if tree.is_dir():
            subprocess.run([*tools.python, "-m", "compileall", "-q", str(tree)], check=True)


def _tools(args: argparse.Namespace) -> Tools:
    """The servers' interpreter (``-X perf`` when profiling on 3.12 or later: each Python
    function named in the profile) and valgrind's tool."""
    python = [args.server_python or sys.executable]
    if args.profile:
        version = subprocess.run(
            [*python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        if version == "True":
            python += ["-X", "perf"]
        else:
            print("(profiles on Python < 3.12 name no Python function: layers are C only)")
    return Tools(tuple(python), profile=bool(args.profile))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        unknown = set(names) - set(allowed)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(sorted(unknown))}")
        return names

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="memory, proxy (and base), 1k and 32k")
    parser.add_argument("--contexts", type=_ints, default=[1000, 8000, 32000])
    parser.add_argument(
        "--modes", type=_names(MODES), default=list(MODES), help="chat, stream (default both)"
    )
    parser.add_argument(
        "--setups",
        type=_names(SETUPS),
        default=None,
        help=f"of {', '.join(SETUPS)} (default: all; base needs --compare-source)",
    )
    parser.add_argument("--turns", type=int, default=4, help="N: turns per rollout (and 2N)")
    parser.add_argument("--tool-output-chars", type=int, default=50)
    parser.add_argument(
        "--rollouts", type=int, default=4, help="rollouts per cell, one after another"
    )
    parser.add_argument("--repeat", type=int, default=1, help="whole runs, to check agreement")
    parser.add_argument("--jobs", type=int, default=2, help="pairs of setups run at once")
    parser.add_argument(
        "--compare-source", metavar="DIR", help="also count a memory gateway from this checkout"
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        type=Path,
        help="run under callgrind, keep the profiles in DIR and print each process's "
        "layers per turn (benchmarks/callgrind_layers.py)",
    )
    parser.add_argument(
        "--server-python",
        metavar="PYTHON",
        help="the counted Python servers' interpreter (a 3.12 one names Python functions "
        "in profiles)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR",
        help="keep each process's valgrind file and log in DIR (cg_annotate reads them)",
    )  # fmt: skip
    parser.add_argument("--serve-model", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return parser


def _defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (Debian: apt-get install valgrind)")
    if args.compare_source:
        args.compare_source = os.path.abspath(args.compare_source)
    if args.setups is None:
        quick = ["memory", "proxy"]
        args.setups = quick if args.quick else [s for s in SETUPS if s != "base"]
        if args.compare_source:
            args.setups.append("base")
    if args.quick:
        args.contexts = [1000, 32000] if args.contexts == [1000, 8000, 32000] else args.contexts
    if "base" in args.setups and not args.compare_source:
        parser.error("setup base needs --compare-source DIR")
    args.tools = _tools(args)


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = _parser()
    args = parser.parse_args()
    if args.serve_model:
        serve_model(args.serve_model)
        return
    _defaults(parser, args)
    cells = [Cell(context, mode) for mode in args.modes for context in args.contexts]
    _precompile(args.tools, args.compare_source)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    model_port = _free_port()
    model_root = f"http://127.0.0.1:{model_port}"
    model = [sys.executable, __file__, "--serve-model", str(model_port)]
    runs = []
    with _process(model, f"{model_root}/v1/models"), contextlib.ExitStack() as stack:
        plans = conversations(model_root, cells, args.turns, args.tool_output_chars)
        for run in range(args.repeat):
            print(f"run {run + 1} of {args.repeat}: {len(cells)} pairs of each of "
                  f"{', '.join(args.setups)}", flush=True)  # fmt: skip
            if args.profile or args.keep:
                directory = (args.profile or args.keep) / f"run{run + 1}"
            else:
                directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            runs.append(measure(args, directory, model_root, plans))
    print(
        f"\n{args.turns} vs {2 * args.turns} turns per rollout, {args.rollouts} rollout(s) "
        f"per cell, tool output {args.tool_output_chars} chars; load {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end on {os.cpu_count()} CPUs; "
        f"{time.perf_counter() - started:.0f} s; servers: {' '.join(args.tools.python)}"
        + (" under callgrind" if args.profile else "")
    )
    if args.compare_source:
        print(f"base: a memory gateway from {args.compare_source}")
    for index, (figures, layers) in enumerate(runs):
        if len(runs) > 1:
            print(f"\n== run {index + 1}")
        print_figures(figures, plans)
        print_ratios(args, figures, cells)
        print_layers(layers, cells)
    if len(runs) > 1:
        print_agreement([figures for figures, _ in runs], cells)
    if args.json:
        out = [
            {setup: {p: {c.label: v for c, v in by.items()} for p, by in procs.items()}
             for setup, procs in figures.items()}
            for figures, _ in runs
        ]  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
