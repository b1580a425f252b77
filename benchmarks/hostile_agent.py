"""One hostile agent against a gateway: memory, fairness and connection attacks, measured.

Starts, each in its own process on loopback: the scripted model (slowed by
``--model-latency-ms``) and ``rollout-gateway serve`` (and, with ``--compare-source``, a
second gateway from another checkout, ``base``, attacked the same way in the same run).
Then, per gateway, each scenario of ``--scenarios``:

* ``memory``: one rollout key, one normal turn in flight on the slow engine, then four
  concurrent valid 16 MiB bodies ``{"messages": [...], "pad": [{}, {}, ...]}``; then one
  16 MiB body ``[{}, ...]``. Prints the gateway's RSS before, its peak (``VmHWM``) and
  after, each request's status, and whether the gateway still serves another rollout.
  ``--memory-cap-mib`` runs the gateways under that address-space limit
  (``RLIMIT_AS``), as a container's memory limit would.
* ``fairness``: ``--victims`` rollouts take turns back to back (a 1k-token history, the
  engine's latency each) for ``--seconds``, alone and then while one agent (its own
  process, one rollout key) sends maximum-size bodies back to back, ``--attackers``
  requests at a time. Prints the victims' turn latency p50 / p99 side by side, unloaded
  and under attack, and their ratio (the target: p99 under attack at most 2x unloaded).
  ``--attack-body`` picks the bodies: ``messages`` (8192 messages filling
  ``--max-body-bytes``: the most parse work a valid body carries), ``string`` (one message
  of that size) or ``pad`` (a small chat plus a ``pad`` array of ``{}``).
* ``fds``: a gateway started with ``RLIMIT_NOFILE`` at ``--nofile`` (256), then
  ``--flood`` (300) connections that send half a request and go silent; then ``/health``
  and a register must still be answered (status, or the error that reached the client).

Example (the figures of issue 26's closing note)::

    python benchmarks/hostile_agent.py --compare-source /path/to/main-checkout

The machine is shared: compare the two gateways within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rollout_gateway import child_processes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
from support.servers import serving  # noqa: E402

ADMIN_TOKEN = "benchmark-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MiB = 1024 * 1024
#: Messages of a victim's history (a system prompt of about 1k tokens and a task).
VICTIM_SYSTEM = "You are a CLI agent. " + "context " * 125


# -- processes -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _limits(memory_cap_mib: int | None, nofile: int | None) -> Any:
    def apply() -> None:
        if memory_cap_mib:
            cap = memory_cap_mib * MiB
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return apply


@dataclass
class Server:
    """A started server process."""

    name: str
    root: str
    proc: subprocess.Popen[bytes]

    def rss_mib(self) -> tuple[float, float]:
        """(current RSS, peak RSS) in MiB, from ``/proc``; zeros once it is gone."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            return 0.0, 0.0
        kib = lambda key: int(status.get(key, "0 kB").split()[0])  # noqa: E731
        return kib("VmRSS") / 1024, kib("VmHWM") / 1024

    def exit_note(self) -> str:
        """How the process ended, or ``alive``."""
        code = self.proc.poll()
        if code is None:
            return "alive"
        return f"DIED (signal {-code})" if code < 0 else f"DIED (exit {code})"


@contextlib.contextmanager
def _server(
    name: str,
    cmd: list[str],
    health_url: str,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    preexec: Any = None,
) -> Iterator[Server]:
    # Dead with this benchmark, even by kill -9; its process group stopped on the way out.
    with serving(
        cmd,
        health_url,
        env=env,
        cwd=cwd,
        headers=ADMIN,
        ready=lambda status: status == 200,
        preexec=preexec,
        stderr=subprocess.DEVNULL,
        timeout_s=60,
    ) as proc:
        yield Server(name, health_url.rsplit("/", 1)[0].removesuffix("/v1"), proc)


@contextlib.contextmanager
def _gateway(
    name: str, model_root: str, source: str | None, options: list[str], preexec: Any = None
) -> Iterator[Server]:
    env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    if source:
        env["PYTHONPATH"] = source
    for attempt in range(3):  # a free port can be taken before the gateway binds it
        port = _free_port()
        cmd = [
            sys.executable, "-m", "rollout_gateway.cli", "serve", "--upstream",
            f"{model_root}/v1", "--port", str(port), "--log-level", "error", *options,
        ]  # fmt: skip
        # `python -m` puts the working directory first on sys.path: run from the source.
        server = _server(
            name, cmd, f"http://127.0.0.1:{port}/health", env=env, cwd=source, preexec=preexec
        )
        try:
            gw = server.__enter__()
        except RuntimeError:
            if attempt == 2:
                raise
            continue
        try:
            yield gw
        finally:
            server.__exit__(None, None, None)
        return


# -- rollouts ------------------------------------------------------------------------------------


async def _register(client: httpx.AsyncClient, root: str, rollout_id: str) -> str:
    body = {"model": "scripted", "sampling_params": {}, "max_turns": -1, "max_seq_len": None}
    r = await client.post(f"{root}/v1/rollouts/{rollout_id}/register", json=body, headers=ADMIN)
    r.raise_for_status()
    return str(r.json().get("api_key", ""))


def _chat_messages(text: str = "Say done.") -> list[dict[str, str]]:
    task = 'Victim task. <script>[{"say": "done"}]</script> ' + text
    return [{"role": "system", "content": VICTIM_SYSTEM}, {"role": "user", "content": task}]


def _pad_body(total: int, *, pad: bool = True, tag: str = "") -> bytes:
    """A valid chat body of ``total`` bytes: a small chat and a ``pad`` array of ``{}``
    (or, ``pad=False``, the bare array ``[{}, ...]``); ``tag`` makes bodies distinct."""
    if not pad:
        return b"[" + b"{}," * ((total - 4) // 3) + b"{}]"
    head = json.dumps({"model": "scripted", "messages": _chat_messages(tag)})[:-1].encode()
    head += b', "pad": ['
    return head + b"{}," * ((total - len(head) - 4) // 3) + b"{}]}"


def attack_body(kind: str, total: int, max_messages: int = 8192, tag: str = "") -> bytes:
    """A maximum-size valid chat body of the given ``kind`` (see the module docstring)."""
    if kind == "pad":
        return _pad_body(total, tag=tag)
    if kind == "string":
        head = f'{{"model": "scripted", "messages": [{{"role": "user", "content": "{tag}'
        return head.encode() + b"attack " * ((total - len(head) - 8) // 7) + b'"}]}'
    # messages: max_messages messages sharing the size.
    per = (total - 64) // max_messages - 40
    text = ("tool output, " * (per // 13 + 1))[:per]
    messages = [{"role": "user", "content": text} for _ in range(max_messages)]
    messages[0]["content"] = tag + text[len(tag) :]
    return json.dumps({"model": "scripted", "messages": messages}).encode()


async def _post(
    client: httpx.AsyncClient, url: str, key: str, content: bytes, timeout: float = 120
) -> str:
    """POST a body; its status, or the error the client got."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        r = await client.post(url, content=content, headers=headers, timeout=timeout)
        return str(r.status_code)
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def _serves(client: httpx.AsyncClient, root: str) -> str:
    """Whether the gateway answers /health and a whole turn of a fresh rollout."""
    try:
        health = await client.get(f"{root}/health", timeout=10)
        rid = f"probe-{time.monotonic_ns()}"
        key = await _register(client, root, rid)
        body = json.dumps({"model": "scripted", "messages": _chat_messages()}).encode()
        status = await _post(client, f"{root}/v1/rollouts/{rid}/chat/completions", key, body)
        return f"health {health.status_code}, a new rollout's turn {status}"
    except httpx.HTTPError as exc:
        return f"unreachable ({type(exc).__name__})"


# -- scenario: memory ----------------------------------------------------------------------------


@dataclass
class MemoryResult:
    rss_start: float
    statuses: list[str]
    peak: float
    rss_after: float
    alive: str
    serves: str


async def memory_scenario(gw: Server, bodies: list[bytes], engine_s: float) -> MemoryResult:
    """One normal turn in flight on the slow engine, then ``bodies`` at once, all on one
    rollout key; the gateway's RSS before, at its peak and after."""
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.sleep(0.5)
        rss_start = gw.rss_mib()[0]
        key = await _register(client, gw.root, "hostile")
        url = f"{gw.root}/v1/rollouts/hostile/chat/completions"
        normal = json.dumps({"model": "scripted", "messages": _chat_messages()}).encode()
        first = asyncio.create_task(_post(client, url, key, normal))
        await asyncio.sleep(min(0.5, engine_s / 4))  # the normal turn waits on the engine
        statuses = await asyncio.gather(*(_post(client, url, key, b) for b in bodies))
        statuses.insert(0, await first)
        peak = gw.rss_mib()[1]
        await asyncio.sleep(1.5)
        rss_after = gw.rss_mib()[0]
        serves = await _serves(client, gw.root) if gw.proc.poll() is None else "-"
    return MemoryResult(rss_start, list(statuses), peak, rss_after, gw.exit_note(), serves)


# -- scenario: fairness --------------------------------------------------------------------------


@dataclass
class Latencies:
    samples: list[float] = field(default_factory=list)
    errors: int = 0

    def pct(self, q: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


async def _victims(root: str, victims: int, seconds: float, tag: str) -> Latencies:
    out = Latencies()
    async with httpx.AsyncClient(timeout=60) as client:
        keys = {}
        for i in range(victims):
            rid = f"victim-{tag}-{i}"
            keys[rid] = await _register(client, root, rid)
        deadline = time.monotonic() + seconds

        async def run(rid: str, key: str) -> None:
            headers = {"Authorization": f"Bearer {key}"}
            url = f"{root}/v1/rollouts/{rid}/chat/completions"
            turn = 0
            while time.monotonic() < deadline:
                # A new request each time (the history grows by one turn's text): never a
                # replay of the previous answer.
                body = {"model": "scripted", "messages": _chat_messages(f"turn {turn}")}
                turn += 1
                start = time.perf_counter()
                try:
                    r = await client.post(url, json=body, headers=headers)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    out.samples.append(time.perf_counter() - start)
                else:
                    out.errors += 1

        await asyncio.gather(*(run(rid, key) for rid, key in keys.items()))
    return out


def _attacker_main(root: str, key: str, rollout_id: str, kind: str, size: int, par: int) -> None:
    """The attacking agent (its own process): ``par`` requests at a time, back to back,
    until SIGTERM; then prints how its requests were answered (JSON, one line)."""
    bodies = [attack_body(kind, size, tag=f"{i} ") for i in range(par)]
    url = f"{root}/v1/rollouts/{rollout_id}/chat/completions"
    statuses: dict[str, int] = {}

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with httpx.AsyncClient(timeout=120) as client:
            print("ready", flush=True)

            async def loop(body: bytes) -> None:
                while True:
                    status = await _post(client, url, key, body)
                    statuses[status] = statuses.get(status, 0) + 1

            tasks = [asyncio.create_task(loop(body)) for body in bodies]
            await stop.wait()
            for task in tasks:
                task.cancel()
        print(json.dumps(statuses), flush=True)

    asyncio.run(main())


@dataclass
class FairnessResult:
    alone: Latencies
    attacked: Latencies
    #: How the attacker's requests were answered: status (or client error) -> count.
    attack_statuses: dict[str, int]


async def fairness_scenario(gw: Server, args: argparse.Namespace, kind: str) -> FairnessResult:
    # Warm-up, then unloaded.
    await _victims(gw.root, args.victims, 1.0, "warm")
    alone = await _victims(gw.root, args.victims, args.seconds, "alone")
    async with httpx.AsyncClient(timeout=30) as client:
        key = await _register(client, gw.root, f"attacker-{kind}")
    attacker = child_processes.spawn(
        [
            sys.executable, __file__, "--attacker", gw.root, key, f"attacker-{kind}", kind,
            str(args.max_body_bytes), str(args.attackers),
        ],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert attacker.stdout is not None
        attacker.stdout.readline()  # ready (its bodies are built)
        await asyncio.sleep(1.0)  # its first requests are in
        attacked = await _victims(gw.root, args.victims, args.seconds, f"attacked-{kind}")
    finally:
        attacker.terminate()
        try:
            out, _ = attacker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            attacker.kill()
            out, _ = attacker.communicate()
    lines = out.decode().strip().splitlines()
    statuses = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return FairnessResult(alone, attacked, statuses)


# -- scenario: file descriptors ------------------------------------------------------------------


async def fds_scenario(root: str, flood: int) -> tuple[int, str, str]:
    host, port = root.removeprefix("http://").split(":")
    held: list[socket.socket] = []
    half = b"POST /v1/rollouts/x/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Le"
    for _ in range(flood):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect((host, int(port)))
        held.append(s)
    await asyncio.sleep(0.5)
    opened = 0
    for s in held:
        with contextlib.suppress(OSError):
            s.send(half)
            opened += 1
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(timeout=10) as client:
        try:
            health = str((await client.get(f"{root}/health")).status_code)
        except httpx.HTTPError as exc:
            health = type(exc).__name__
        try:
            body = {"model": "scripted", "sampling_params": {}, "max_turns": -1}
            r = await client.post(f"{root}/v1/rollouts/fd-probe/register", json=body, headers=ADMIN)
            register = str(r.status_code)
        except httpx.HTTPError as exc:
            register = type(exc).__name__
    for s in held:
        s.close()
    return opened, health, register


# -- main ----------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="memory,fairness,fds")
    p.add_argument("--compare-source", metavar="DIR", help="a second gateway from DIR (base)")
    p.add_argument("--model-latency-ms", type=float, default=100.0)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=131072,
        help="the model's context: longer prompts are refused as vLLM does (400)",
    )
    p.add_argument(
        "--memory-engine-ms",
        type=float,
        default=3000.0,
        help="engine latency of the memory scenario (bodies pile up behind it)",
    )
    p.add_argument("--memory-cap-mib", type=int, default=None)
    p.add_argument("--max-body-bytes", type=int, default=16 * MiB)
    p.add_argument("--victims", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--attackers", type=int, default=4, help="the attacker's requests at a time")
    p.add_argument(
        "--attack-body",
        default="messages,pad",
        help="comma-separated kinds of attacking bodies: messages, string, pad",
    )
    p.add_argument("--nofile", type=int, default=256)
    p.add_argument("--flood", type=int, default=300)
    p.add_argument(
        "--gateway-option",
        action="append",
        default=[],
        metavar="OPT",
        help="extra serve option of every gateway (repeatable; --gateway-option=--x)",
    )
    p.add_argument("--attacker", nargs=6, help=argparse.SUPPRESS)
    return p  # fmt: skip


def _model(latency_ms: float, max_model_len: int) -> contextlib.AbstractContextManager[Server]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "rollout_gateway.cli", "scripted-model", "--port", str(port),
        "--log-level", "error", "--latency-ms", str(latency_ms),
        "--max-model-len", str(max_model_len),
    ]  # fmt: skip
    return _server("model", cmd, f"http://127.0.0.1:{port}/v1/models")


Sources = list[tuple[str, str | None]]


def run_memory(args: argparse.Namespace, sources: Sources, options: list[str]) -> None:
    """The memory scenario: each attack against each gateway; RSS before, peak, after."""
    size = args.max_body_bytes
    print(
        f"\n== memory: one rollout key, engine {args.memory_engine_ms:g} ms; one normal turn "
        f"in flight, then the bodies below at once; address-space cap "
        f"{args.memory_cap_mib or 'none'} MiB; RSS in MiB"
    )
    attacks = {
        f"4 x {size / MiB:g} MiB chat + pad of {{}}": [
            _pad_body(size, tag=str(i)) for i in range(4)
        ],
        f"1 x {size / MiB:g} MiB bare [{{}}, ...]": [_pad_body(size, pad=False)],
        f"4 x {size / MiB:g} MiB of 8192 messages": [
            attack_body("messages", size, tag=str(i)) for i in range(4)
        ],
    }
    with _model(args.memory_engine_ms, args.max_model_len) as model:
        for label, bodies in attacks.items():
            for name, source in sources:
                preexec = _limits(args.memory_cap_mib, None)
                with _gateway(name, model.root, source, options, preexec) as gw:
                    m = asyncio.run(memory_scenario(gw, bodies, args.memory_engine_ms / 1000))
                print(
                    f"{name:8s} {label}: RSS {m.rss_start:.0f} -> peak {m.peak:.0f}, "
                    f"{m.rss_after:.0f} after; statuses {' '.join(m.statuses)}; "
                    f"process {m.alive}; {m.serves}"
                )


def run_fairness(args: argparse.Namespace, sources: Sources, options: list[str]) -> None:
    """The fairness scenario: victims' turn latency alone and beside an attacker."""
    print(
        f"\n== fairness: {args.victims} victim rollouts take turns back to back (engine "
        f"{args.model_latency_ms:g} ms, context {args.max_model_len} tokens), "
        f"{args.seconds:g} s alone, then {args.seconds:g} s while one agent (one rollout "
        f"key) sends {args.attackers} x {args.max_body_bytes / MiB:g} MiB bodies at a "
        "time, back to back; victims' turn latency in ms"
    )
    with _model(args.model_latency_ms, args.max_model_len) as model:
        for kind in args.attack_body.split(","):
            for name, source in sources:
                with _gateway(name, model.root, source, options) as gw:
                    f = asyncio.run(fairness_scenario(gw, args, kind))
                    alive = gw.exit_note()
                alone, hit = f.alone, f.attacked
                ratio = hit.pct(0.99) / alone.pct(0.99) if alone.samples else 0.0
                print(
                    f"{name:8s} '{kind}' bodies: unloaded p50 {alone.pct(0.5):.0f} p99 "
                    f"{alone.pct(0.99):.0f} ({len(alone.samples)} turns) | under attack p50 "
                    f"{hit.pct(0.5):.0f} p99 {hit.pct(0.99):.0f} ({len(hit.samples)} turns, "
                    f"{hit.errors} failed) | p99 ratio {ratio:.2f} (target <= 2) | gateway "
                    f"{alive}; attacker's answers {f.attack_statuses}"
                )


def run_fds(args: argparse.Namespace, sources: Sources, options: list[str]) -> None:
    """The fds scenario: half-sent connections against a low descriptor limit."""
    print(
        f"\n== fds: gateway with RLIMIT_NOFILE {args.nofile}; {args.flood} connections send "
        f"half a request and go silent; then /health and register"
    )
    with _model(0, args.max_model_len) as model:
        for name, source in sources:
            preexec = _limits(None, args.nofile)
            with _gateway(name, model.root, source, options, preexec) as gw:
                opened, health, register = asyncio.run(fds_scenario(gw.root, args.flood))
                alive = gw.exit_note()
            print(
                f"{name:8s} {opened} half-sent connections held; /health: {health}; "
                f"register: {register}; gateway {alive}"
            )


#: Each scenario of ``--scenarios`` by name.
SCENARIOS = {"memory": run_memory, "fairness": run_fairness, "fds": run_fds}


def main() -> None:
    """Run the scenarios (or the attacker process) and print the figures."""
    parser = _parser()
    args = parser.parse_args()
    unknown = set(args.scenarios.split(",")) - SCENARIOS.keys()
    if unknown:
        parser.error(f"--scenarios: unknown {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    if args.attacker:
        root, key, rid, kind, size, par = args.attacker
        _attacker_main(root, key, rid, kind, int(size), int(par))
        return
    sources: Sources = [("gateway", None)]
    if args.compare_source:
        sources.append(("base", os.path.abspath(args.compare_source)))
    print(
        f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
        "gateways: "
        + ", ".join(n + (f" from {s}" if s else " (this checkout)") for n, s in sources)
    )
    options = ["--max-body-bytes", str(args.max_body_bytes), *args.gateway_option]
    for name in args.scenarios.split(","):
        SCENARIOS[name](args, sources, options)


if __name__ == "__main__":
    main()
