"""Instructions per turn of a Messages or Responses turn against a chat turn (issue 31).

One gateway process runs under valgrind's callgrind; the scripted model (its card saying
vLLM, so the gateway streams from it as from vLLM) and this driver run natively, not
counted. For each cell (dialect x streamed or not x context size) a fresh rollout takes
``N`` turns (warm-up), the counters are dumped (``callgrind_control --dump``), it takes
``N`` more, and they are dumped again: the second dump over ``N`` is what one turn of
that conversation costs the gateway (turns ``N+1 .. 2N``). The conversation is the same
in every dialect (a system prompt padded to the cell's context in the scripted model's
tokens, one byte each; the model answers a short text; the agent echoes it and adds a
user message), in each dialect's own shape, as its official SDK sends it; ``claude-code``
is the Messages dialect as Claude Code writes it, a cache breakpoint on the system prompt
and on the newest message's last block (it moves every turn: the previous last
message's bytes change). The gateway
is ``rollout-gateway serve`` with its timers quiet (:func:`serve_gateway`: its tick, its
idle sweep and its health probe once an hour), so nothing in it runs by the wall clock
during a cell: its idle count is printed first (a few hundred instructions in seconds),
and a cell's count is its turns' own, not corrected for timers. (Before, the tick ran
once a second, some 87,000 instructions under valgrind, and an idle rate measured once
was subtracted for a cell's wall-clock time: a cell's count moved by 2% run to run.)
What remains differs run to run only by the machine's timing in the I/O (how a read
splits); ``--repeat`` runs every cell again and the least count of each cell is
reported (the noise only adds).
Before the first cell, each cell's conversation runs :data:`WARM_UP_TURNS` turns,
uncounted (:func:`warm_up`: CPython quickens a function's code on its first calls, and
the first cells measured paid for it).

``--compare-source DIR`` also runs every cell through the gateway of another checkout
(e.g. ``git worktree add --detach DIR main``), in the same run: the chat turn no
costlier than before, and each dialect turn's cost before and after a change.
``--keep DIR`` keeps each cell's callgrind dump (``callgrind_annotate`` it, or diff two
cells' with ``benchmarks/callgrind_layers.py``). ::

    python benchmarks/dialect_instructions.py                 # 1k and 32k, whole and streamed
    python benchmarks/dialect_instructions.py --compare-source /tmp/base --contexts 1000

Needs ``valgrind``. A gateway under callgrind runs some 100 times slower: start-up takes
tens of seconds, a turn tens of milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollout_gateway import child_processes

ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DIALECTS = ("chat", "anthropic", "responses", "claude-code")
START_TIMEOUT_S = 600.0
#: Seconds between the counted gateway's timers (its tick, its sweep, its health probe).
QUIET_S = 3600.0
#: Turns of each cell's conversation before any cell is counted (see :func:`warm_up`).
WARM_UP_TURNS = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, headers=headers, timeout=5).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: not ready")


def serve_model(port: int) -> None:
    """The scripted model with a vLLM card (streamed from as from vLLM). Not counted."""
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
        await app(scope, receive, send)

    uvicorn.run(as_vllm, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@dataclass(frozen=True)
class Cell:
    dialect: str
    stream: bool
    context: int

    @property
    def label(self) -> str:
        return f"{self.context // 1000}k {'stream' if self.stream else 'whole'} {self.dialect}"


def _says(turns: int) -> list[str]:
    return [f"Step {i}: the files are a.txt and b.txt, nothing else." for i in range(turns)]


def _system(turns: int, context: int) -> str:
    script = json.dumps([{"say": text} for text in _says(turns)])
    head = f"You are a shell agent. <script>{script}</script> "
    return head + "x" * max(0, context - len(head))


def body(cell: Cell, system: str, answers: list[str]) -> tuple[str, dict[str, Any]]:
    """The request of the turn after ``answers``, in the cell's dialect: its path under
    the rollout and its body."""
    users = ["List the files."] + [f"Go on ({i})." for i in range(len(answers))]
    if cell.dialect == "chat":
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for i, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        out: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 256}
        return "/chat/completions", out | ({"stream": True} if cell.stream else {})
    if cell.dialect in ("anthropic", "claude-code"):
        turns: list[dict[str, Any]] = []
        for i, user in enumerate(users):
            turns.append({"role": "user", "content": [{"type": "text", "text": user}]})
            if i < len(answers):
                turns.append({"role": "assistant",
                              "content": [{"type": "text", "text": answers[i]}]})  # fmt: skip
        out = {"model": "m", "max_tokens": 256, "system": [{"type": "text", "text": system}],
               "messages": turns, "stream": cell.stream}  # fmt: skip
        if cell.dialect == "claude-code":  # its cache breakpoints: the newest message's
            out["system"][0]["cache_control"] = {"type": "ephemeral"}
            turns[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        return "/v1/messages", out
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": system}]}
    ]  # fmt: skip
    for i, user in enumerate(users):
        items.append({"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": user}]})  # fmt: skip
        if i < len(answers):
            items.append({"type": "message", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": answers[i],
                                       "annotations": []}]})  # fmt: skip
    out = {"model": "m", "input": items, "max_output_tokens": 256, "store": False,
           "stream": cell.stream}  # fmt: skip
    return "/responses", out


def serve_gateway(argv: list[str]) -> None:
    """``rollout-gateway serve`` with its timers quiet: the server's housekeeping tick (the
    ``Date`` header, some 87,000 instructions under valgrind once a second) and the idle
    sweep run once an hour, not once a second and every 30 s.

    A tick's cost fell in a cell's counted turns or not by the wall clock (a 3-turn cell
    of 1-2 s holds one tick or two: some 29,000 instructions a turn at 1k either way), and
    the correction for it, an idle rate measured once, moved a cell's count by 2% run to
    run. Quiet, nothing in the gateway runs by the clock during a cell: the count is the
    turns' own. Everything else is the command's own path (``cli.main``)."""
    from dataclasses import replace

    from rollout_gateway import cli
    from rollout_gateway.server import runner

    class QuietServer(runner._Server):
        def __init__(self, config: Any, tick_s: float = QUIET_S) -> None:
            super().__init__(config, tick_s)

    def quiet_config(args: Any) -> Any:
        config = make_config(args)
        return replace(config, registry=replace(config.registry, sweep_interval_s=QUIET_S))

    make_config = cli.serve_config
    _patient_health_probe()
    runner._Server = QuietServer  # type: ignore[misc]  # serve() builds its server by this name
    cli.serve_config = quiet_config  # run_serve builds its config by this name
    sys.exit(cli.main(["serve", *argv]))


def _patient_health_probe() -> None:
    """The gateway's health probe waits for the model as long as the start does: under
    callgrind on a loaded machine its first probe outlasted the usual 2 s bound, the
    upstream was marked down and, probed again only an hour later, never served a turn
    (the run waited for ``/health`` until it gave up)."""
    from rollout_gateway.server import app as app_module

    monitor = getattr(app_module, "HealthMonitor", None)
    if monitor is None:  # (a checkout without the probe)
        return

    class PatientMonitor(monitor):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("timeout_s", START_TIMEOUT_S)
            super().__init__(*args, **kwargs)

    app_module.HealthMonitor = PatientMonitor  # the gateway builds its monitor by this name


class Gateway:
    """One gateway under callgrind, its counters dumped on demand."""

    def __init__(self, model_root: str, directory: Path, source: str | None) -> None:
        self.port = _free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.out = directory / "callgrind.out"
        cmd = ["valgrind", "-q", "--tool=callgrind", f"--callgrind-out-file={self.out}",
               sys.executable, str(Path(__file__).resolve()), "--serve-gateway",
               "--upstream", f"{model_root}/v1", "--port", str(self.port),
               "--log-level", "warning"]  # fmt: skip
        first = str(Path(source).resolve()) if source else str(Path(__file__).resolve().parents[1])
        if (Path(first) / "rollout_gateway/server/ops/health.py").exists():
            # Its periodic health probe (a GET upstream every second) once an hour: it
            # costs per second, and a loaded machine's turns take seconds.
            cmd += ["--probe-interval", str(QUIET_S)]
        env = {**os.environ, "PYTHONHASHSEED": "0", "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
               "PYTHONPATH": first}  # fmt: skip
        log = open(directory / "gateway.log", "ab")  # noqa: SIM115
        # Its own group, dead with this process (set before valgrind's exec).
        self.proc = child_processes.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=source)  # fmt: skip
        self.dumps = 0
        _wait(f"{self.root}/health", self.proc, ADMIN)

    def idle_count(self, seconds: float = 3.0) -> int:
        """Instructions while nobody calls it for ``seconds`` (its timers quiet: ~0)."""
        self.dump()
        time.sleep(seconds)
        return self.dump()

    def dump(self, keep: Path | None = None) -> int:
        """The instructions since the previous dump (its file copied to ``keep``)."""
        subprocess.run(["callgrind_control", "--dump", str(self.proc.pid)], check=True,
                       capture_output=True)  # fmt: skip
        self.dumps += 1
        path = Path(f"{self.out}.{self.dumps}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.exists():
                text = path.read_text()
                for line in text.splitlines():
                    if line.startswith(("totals:", "summary:")):
                        if keep is not None:
                            keep.write_text(text)
                        return int(line.split()[1])
            time.sleep(0.1)
        raise RuntimeError(f"no dump at {path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_cell(
    client: httpx.Client, gateway: Gateway, cell: Cell, turns: int, n: int, keep: Path | None
) -> float:
    """Instructions per turn of the cell (turns ``turns+1 .. 2 turns``)."""
    rollout = f"{cell.dialect}-{int(cell.stream)}-{cell.context}-{n}"
    system = _system(2 * turns, cell.context)
    reg = client.post(f"{gateway.root}/v1/rollouts/{rollout}/register", headers=ADMIN,
                      json={"model": "scripted", "max_turns": -1})  # fmt: skip
    reg.raise_for_status()
    base = f"{gateway.root}/v1/rollouts/{rollout}"
    key = reg.json()["api_key"]
    messages_api = cell.dialect in ("anthropic", "claude-code")
    auth = {"x-api-key": key} if messages_api else {"Authorization": f"Bearer {key}"}
    answers: list[str] = []
    counted = 0
    for turn in range(2 * turns):
        if turn == turns:
            gateway.dump()  # everything before: not counted
        path, request = body(cell, system, answers)
        r = client.post(base + path, json=request, headers=auth)
        r.raise_for_status()
        if turn >= turns:
            counted += 1
        answers.append(_says(2 * turns)[turn])
    per_turn = gateway.dump(keep) / counted
    client.post(f"{base}/unregister", headers=ADMIN).raise_for_status()
    return per_turn


def warm_up(client: httpx.Client, gateway: Gateway, args: argparse.Namespace) -> None:
    """Not counted: each cell's path run :data:`WARM_UP_TURNS` times first. CPython 3.11
    quickens a function's code at its 8th call and specializes its instructions over
    the next ones; a path run only a few times before (the 4 turns of a short rollout,
    then a cell's own 3) paid that in the first cell measured: some 6,000 instructions a
    turn in ``_PyCode_Quicken`` alone for a Responses turn at 1k, more in the slower
    unspecialized code, and the 1k cells come first."""
    for context in args.contexts:
        for mode in args.modes:
            for dialect in args.dialects:
                cell = Cell(dialect, mode == "stream", context)
                run_cell(client, gateway, cell, WARM_UP_TURNS // 2, -1, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1000, 32000])
    parser.add_argument("--turns", type=int, default=4, help="N: warm-up turns, then N counted")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--compare-source", help="another checkout: its turns too, same cells")
    parser.add_argument("--dialects", nargs="+", default=list(DIALECTS), choices=DIALECTS)
    parser.add_argument("--keep", type=Path, help="a folder to keep each cell's callgrind dump in")
    parser.add_argument("--modes", nargs="+", default=["whole", "stream"])
    args = parser.parse_args()
    model_port = _free_port()
    model = child_processes.spawn([sys.executable, __file__, "--serve-model", str(model_port)])
    model_root = f"http://127.0.0.1:{model_port}"
    results: dict[str, list[float]] = {}
    try:
        _wait(f"{model_root}/v1/models", model)
        with tempfile.TemporaryDirectory() as tmp, httpx.Client(timeout=600) as client:
            sources = [("", None)]
            if args.compare_source:
                sources.append(("base ", args.compare_source))
            for prefix, source in sources:
                directory = Path(tmp) / (prefix.strip() or "this")
                directory.mkdir()
                gateway = Gateway(model_root, directory, source)
                try:
                    idle = gateway.idle_count()
                    print(f"{prefix}gateway idle: {idle} instructions in 3 s", flush=True)
                    warm_up(client, gateway, args)
                    for n in range(args.repeat):
                        for context in args.contexts:
                            for mode in args.modes:
                                for dialect in args.dialects:
                                    cell = Cell(dialect, mode == "stream", context)
                                    keep = None
                                    if args.keep is not None:
                                        args.keep.mkdir(parents=True, exist_ok=True)
                                        name = f"{prefix}{cell.label}.{n}".replace(" ", "-")
                                        keep = args.keep / f"callgrind.{name}"
                                    value = run_cell(client, gateway, cell, args.turns, n, keep)
                                    results.setdefault(prefix + cell.label, []).append(value)
                                    print(f"{prefix}{cell.label:28s} {value / 1e6:8.3f} M/turn",
                                          flush=True)  # fmt: skip
                finally:
                    gateway.stop()
    finally:
        model.terminate()
        model.wait()
    print("\nratios (least count of the repeats) against the chat turn of the same cell:")
    for context in args.contexts:
        for mode in args.modes:
            label = f"{context // 1000}k {mode}"
            _ratios(results, label, args.dialects, "this" if args.compare_source else "")
            if args.compare_source:
                _ratios(results, label, args.dialects, "base")
                for dialect in args.dialects:
                    value = min(results[f"{label} {dialect}"])
                    base = min(results[f"base {label} {dialect}"])
                    print(f"  {label} {dialect:10s} this / base {value / base:6.3f}x")


def _ratios(results: dict[str, list[float]], label: str, dialects: list[str], side: str) -> None:
    """Each dialect's least count against chat's, in one cell of one side."""
    prefix = "base " if side == "base" else ""
    chat = min(results[f"{prefix}{label} chat"]) if "chat" in dialects else None
    for dialect in dialects:
        value = min(results[f"{prefix}{label} {dialect}"])
        ratio = f"{value / chat:6.3f}x" if chat else ""
        print(f"  {side:4s} {label} {dialect:10s} {value / 1e6:7.3f} M  {ratio}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-model":
        serve_model(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--serve-gateway":
        serve_gateway(sys.argv[2:])
    else:
        main()
