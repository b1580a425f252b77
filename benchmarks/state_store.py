"""What the gateway's state backends cost, side by side in one run.

Starts, each in its own process on loopback: the scripted model and one gateway per
backend (``memory``: the default; ``sqlite``: ``serve --state-dir``, ``--state-sync
normal``; ``sqlite-full``: ``--state-sync full``; with ``--compare-source DIR``, ``base``:
a memory gateway from another checkout, e.g. of main). Then, in one run:

1. **CPU per turn** of each gateway process (every thread: the SQLite writer's included)
   and latency, for each context size at ``--rollouts`` concurrent rollouts; the backends
   take turns round by round (``gateway_overhead.py``'s load and rounds), so a drift of a
   shared machine weighs on each alike. Ratios to ``memory`` (and ``memory`` to ``base``).
2. **Bytes on disk per stored token**: ``--rollouts`` rollouts of ``--turns`` turns per
   context through the ``sqlite`` gateway, kept; the gateway is stopped (its log folded
   into the database) and the database's size divided by the token ids it holds (each
   id once per branch, as the memory recorder holds them), with the share of each part.

Parts 1 and 2 run for each ``--text``: ``scripted`` (the scripted model's byte tokenizer:
about 1 byte of text per token, and repetitive text) and ``realistic`` (made-up
English-like text that compresses as English prose does, tokenized 4 bytes per token, ids
in a real vocabulary's range: ``scripted-model --bytes-per-token 4``), the same
conversations in tokens.
3. **Restart to serving**: a state directory holding ``--restart-rollouts`` rollouts of
   ``--restart-turns`` turns (1k-token context, written through the store's own commit
   path in this process: 40,000 turns through HTTP would take minutes) and a
   ``serve --state-dir`` started on it: seconds from the process start to ``/health``
   answering, and to the first turn of a restored rollout answered (its steps are loaded
   at first use); a memory gateway's start beside it.

Every figure is printed with its target. One command; ``--quick`` (fewer turns per cell,
one restart) runs in under 3 minutes on a 16-core host::

    python benchmarks/state_store.py --quick
    python benchmarks/state_store.py --compare-source ../main   # the memory backend vs main
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sqlite3
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from gateway_overhead import (
    ADMIN,
    ADMIN_TOKEN,
    Agent,
    Load,
    RunResult,
    Target,
    _drive_here,
    _first_messages,
    _free_port,
    _one_round,
    _process,
    _register,
    merge_run,
    rounds_for,
)

from rollout_gateway.scripted import build_completion
from rollout_gateway.server.recording.recorder import TrajectoryRecorder
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.registry import RolloutRecord
from rollout_gateway.server.state.rows import new_row
from rollout_gateway.server.state.sqlite import SQLiteStore
from rollout_gateway.server.state.store import AnswerKey, TurnAnswer, TurnCommit

CLI = [sys.executable, "-m", "rollout_gateway.cli"]


def _serve(model_root: str, port: int, *extra: str) -> list[str]:
    return [
        *CLI, "serve", "--upstream", f"{model_root}/v1", "--port", str(port),
        "--max-rollouts", "20000", "--log-level", "warning", *extra,
    ]  # fmt: skip


# -- 1. CPU per turn ---------------------------------------------------------------------


def measure_cpu(
    args: argparse.Namespace, targets: list[Target], pids: dict[str, int], bytes_per_token: int
) -> dict[tuple[int, str], RunResult]:
    """(context, backend) -> the cell's figures over at least ``--min-turns`` turns."""
    results: dict[tuple[int, str], RunResult] = {}
    for context in args.contexts:
        for _ in range(rounds_for(args.min_turns, args.rollouts, args.turns)):
            for target in targets:
                res = asyncio.run(
                    _one_round(
                        target, pids, rollouts=args.rollouts, turns=args.turns,
                        context_tokens=context, tool_chars=args.tool_output_chars,
                        clients=args.clients, start_spread_s=args.model_latency_ms / 1000,
                        bytes_per_token=bytes_per_token,
                    )
                )  # fmt: skip
                merge_run(results.setdefault((context, target.name), RunResult([], 0.0, {})), res)
    return results


# -- 2. bytes on disk per stored token -------------------------------------------------------


async def _fill_over_http(
    root: str, rollouts: int, turns: int, context: int, tool_chars: int, bytes_per_token: int
) -> int:
    """Run rollouts through a gateway and keep them; the token ids they stored."""
    async with httpx.AsyncClient(base_url=root, timeout=120, headers=ADMIN) as control:
        ids = [f"disk_{context}_{i}" for i in range(rollouts)]
        keys = await _register(control, ids)
        agents = [
            Agent(f"/v1/rollouts/{i}/chat/completions", k) for i, k in zip(ids, keys, strict=True)
        ]
        await _drive_here(Load(root, agents, turns, context, tool_chars, bytes_per_token), {})
        stored = 0
        for rollout_id in ids:
            r = await control.get(f"/v1/rollouts/{rollout_id}/trajectory?format=delta")
            for step in r.json()["trajectory"]:
                tokens = step["tokens"] or {}
                stored += len(tokens.get("prompt_new_ids", ())) + len(
                    tokens.get("completion_ids", ())
                )
        return stored


def measure_disk(
    args: argparse.Namespace, model_root: str, bytes_per_token: int
) -> list[dict[str, Any]]:
    """Per context: the database's bytes, the token ids it holds, and its parts."""
    figures = []
    for context in args.contexts:
        state = Path(tempfile.mkdtemp(prefix="rg-state-disk-"))
        try:
            port = _free_port()
            root = f"http://127.0.0.1:{port}"
            env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
            serve = _serve(model_root, port, "--state-dir", str(state))
            with _process(serve, f"{root}/health", env=env):
                stored = asyncio.run(
                    _fill_over_http(
                        root,
                        args.rollouts,
                        args.turns,
                        context,
                        args.tool_output_chars,
                        bytes_per_token,
                    )  # fmt: skip
                )
            # Stopped: its log is folded into the database (what stays on disk).
            size = sum(f.stat().st_size for f in state.iterdir() if f.name.startswith("state.db"))
            turns = args.rollouts * args.turns
            parts = _parts(state / "state.db")
            figures.append(
                {"context": context, "bytes": size, "stored": stored, "turns": turns, **parts}
            )
        finally:
            shutil.rmtree(state, ignore_errors=True)
    return figures


def _parts(path: Path) -> dict[str, int]:
    """Bytes of the token arrays, of the rest of the steps (messages, facts, counters),
    and of the last answers."""
    conn = sqlite3.connect(path)
    tokens = rest = answers = 0
    try:
        for body, counters in conn.execute("SELECT body, counters FROM steps"):
            payload = codec.unseal(body, "step")
            # The step header of codec.FORMAT_VERSION 2: version, flags, shared messages,
            # prefix, new prompt ids, completion ids, JSON length; flag 16: 3-byte ids.
            _, flags, _, _, new, completion, _ = struct.unpack_from("<BBIIIII", payload)
            arrays = (3 if flags & 16 else 4) * (new + completion) + 4 * completion
            tokens += arrays
            rest += len(body) - arrays + len(counters)
        for (answer,) in conn.execute("SELECT answer FROM answers WHERE answer IS NOT NULL"):
            answers += len(answer)
    finally:
        conn.close()
    return {"token_bytes": tokens, "step_rest": rest, "answer_bytes": answers}


# -- 3. restart to serving -------------------------------------------------------------------


async def fill_directly(state: Path, rollouts: int, turns: int, tool_chars: int) -> None:
    """``rollouts`` rollouts of ``turns`` scripted turns at a 1k context, written through the
    store's commit path (the turns the scripted model answers, recorded as the gateway
    records them; 50 rollouts at a time, each turn after the previous one is stored)."""
    store = SQLiteStore(state)
    await store.open()
    try:
        for first in range(0, rollouts, 50):
            batch = range(first, min(rollouts, first + 50))
            await asyncio.gather(*(_held_rollout(store, r, turns, tool_chars) for r in batch))
    finally:
        await store.close()


async def _held_rollout(store: SQLiteStore, index: int, turns: int, tool_chars: int) -> None:
    record = RolloutRecord(
        rollout_id=f"held_{index}", model="scripted", sampling_params={}, max_turns=turns + 10,
        max_seq_len=None, upstream="http://127.0.0.1:1/v1", last_activity=0.0,
        key_digest=f"{index:064x}",
    )  # fmt: skip
    await store.create_rollout(new_row(record))
    recorder = TrajectoryRecorder(record.trajectory_id)
    messages = _first_messages(turns, 1000)
    for turn in range(turns):
        body = {"messages": messages, "return_token_ids": True, "logprobs": True}
        completion = build_completion(body, "scripted")
        choice = completion["choices"][0]
        message = {k: v for k, v in choice["message"].items() if v is not None}
        recorder.record(
            messages, [message], prompt_ids=completion["prompt_token_ids"],
            completion_ids=choice["token_ids"],
            completion_logprobs=[c["logprob"] for c in choice["logprobs"]["content"]],
            finish_reason=choice["finish_reason"], extras={"usage": completion["usage"]},
        )  # fmt: skip
        answer = TurnAnswer(AnswerKey(b"\0" * 16, None, time.time(), turn), completion)
        counters: Any = {"status": "active", "num_turns": turn + 1, "updated_at": time.time()}
        await store.commit_turn(
            record.rollout_id, TurnCommit(turn, recorder.last_step, counters, answer)
        )
        messages = [*messages, message]
        for call in message.get("tool_calls") or ():
            output = (f"output of turn {turn} " * (tool_chars // 16 + 1))[:tool_chars]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})


def _start_seconds(
    cmd: list[str], root: str, first_turn: tuple[str, str] | None
) -> tuple[float, float | None]:
    """Seconds from starting ``cmd`` to ``/health`` answering, and to ``first_turn``
    (rollout id, key) answered."""
    import subprocess

    from rollout_gateway import child_processes

    env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    started = time.perf_counter()
    # Dead with this benchmark, even by kill -9 (the start is what is timed: no wait).
    proc = child_processes.spawn(cmd, env=env, stdout=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{root}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.005)
        healthy = time.perf_counter() - started
        turned = None
        if first_turn is not None:
            rollout_id, _ = first_turn
            r = httpx.get(f"{root}/v1/rollouts/{rollout_id}/trajectory", headers=ADMIN, timeout=60)
            r.raise_for_status()
            turned = time.perf_counter() - started
        return healthy, turned
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure_restart(args: argparse.Namespace, model_root: str) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="rg-state-restart-"))
    try:
        began = time.perf_counter()
        asyncio.run(
            fill_directly(state, args.restart_rollouts, args.restart_turns, args.tool_output_chars)
        )
        fill_s = time.perf_counter() - began
        size = (state / "state.db").stat().st_size
        port = _free_port()
        root = f"http://127.0.0.1:{port}"
        runs = [
            _start_seconds(
                _serve(model_root, port, "--state-dir", str(state)), root, ("held_7", "")
            )
            for _ in range(args.restart_runs)
        ]
        memory = [
            _start_seconds(_serve(model_root, port), root, None)[0]
            for _ in range(args.restart_runs)
        ]
        return {"fill_s": fill_s, "bytes": size, "runs": runs, "memory": memory}
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _path_with(source: str) -> str:
    """``PYTHONPATH`` for a gateway from ``source``: it first, this checkout left out."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([source, *(p for p in rest if os.path.abspath(p) != here)])


# -- the run ---------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns per cell, one restart")
    parser.add_argument("--contexts", type=_ints, default=[1000, 32000], help="context tokens")
    parser.add_argument("--rollouts", type=int, default=64, help="concurrent rollouts")
    parser.add_argument("--turns", type=int, default=40, help="turns per conversation")
    parser.add_argument(
        "--min-turns", type=int, default=7680, help="turns measured per cell (--quick: 2560)"
    )
    parser.add_argument(
        "--clients", type=int, default=1,
        help="load-generator processes per round (on a many-core host, e.g. 4)",
    )  # fmt: skip
    parser.add_argument("--tool-output-chars", type=int, default=200)
    parser.add_argument(
        "--model-latency-ms", type=float, default=0.0,
        help="the scripted model's time per completion (a sleep): latencies then say what "
        "each backend adds to a turn at a model's pace (default 0: back to back)",
    )  # fmt: skip
    parser.add_argument("--sync", default="normal,full", help="SQLite --state-sync modes to run")
    parser.add_argument("--restart-rollouts", type=int, default=1000)
    parser.add_argument("--restart-turns", type=int, default=40)
    parser.add_argument("--restart-runs", type=int, default=3)
    parser.add_argument(
        "--compare-source", metavar="DIR",
        help="also run a memory gateway from this checkout (e.g. of main) as 'base'",
    )  # fmt: skip
    parser.add_argument(
        "--compare-sqlite", action="store_true",
        help="with --compare-source: also a SQLite gateway from that checkout ('base-sqlite')",
    )  # fmt: skip
    parser.add_argument(
        "--text", default="scripted,realistic",
        help="the conversations' text, comma-separated: scripted (1 byte per token, "
        "repetitive), realistic (made-up English-like text, 4 bytes per token); CPU and disk "
        "are measured for each (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--skip", default="", help="parts to leave out: cpu, disk, restart (comma-separated)"
    )
    return parser


#: ``--text`` -> the scripted model's bytes per token.
TEXTS = {"scripted": 1, "realistic": 4}


def main() -> None:
    """Run the benchmark and print its figures."""
    args = _parser().parse_args()
    if args.quick:
        args.min_turns = min(args.min_turns, 2560)
        args.restart_runs = 1
    skip = set(args.skip.split(","))
    texts = [t for t in args.text.split(",") if t]
    if not texts or any(t not in TEXTS for t in texts):
        raise SystemExit(f"--text: a comma-separated list of {', '.join(TEXTS)}")
    load_start = os.getloadavg()[0]
    cpu: dict[str, dict[tuple[int, str], RunResult]] = {}
    disk: dict[str, list[dict[str, Any]]] = {}
    restart = None
    for text in texts:
        with contextlib.ExitStack() as stack:
            model_root = _model(stack, args, TEXTS[text])
            if "cpu" not in skip:
                cpu[text] = _cpu_part(stack, args, model_root, TEXTS[text])
            if "disk" not in skip:
                disk[text] = measure_disk(args, model_root, TEXTS[text])
            if "restart" not in skip and restart is None:
                restart = measure_restart(args, model_root)
    _report(args, load_start, cpu, disk, restart)


def _model(stack: contextlib.ExitStack, args: argparse.Namespace, bytes_per_token: int) -> str:
    """Start the scripted model; its root."""
    port = _free_port()
    root = f"http://127.0.0.1:{port}"
    stack.enter_context(
        _process([*CLI, "scripted-model", "--port", str(port), "--log-level", "warning",
                  "--latency-ms", str(args.model_latency_ms),
                  "--bytes-per-token", str(bytes_per_token)], f"{root}/v1/models")
    )  # fmt: skip
    return root


def _cpu_part(
    stack: contextlib.ExitStack, args: argparse.Namespace, model_root: str, bytes_per_token: int
) -> dict[tuple[int, str], RunResult]:
    """Start a gateway per backend and measure each one's CPU per turn."""
    admin_env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    backends: list[tuple[str, list[str], dict[str, str]]] = [("memory", [], {})]
    for mode in filter(None, args.sync.split(",")):
        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="rg-state-cpu-"))
        name = "sqlite" if mode == "normal" else f"sqlite-{mode}"
        backends.append((name, ["--state-dir", state, "--state-sync", mode], {}))
    source = os.path.abspath(args.compare_source) if args.compare_source else None
    if source is not None:
        backends.append(("base", [], {"PYTHONPATH": _path_with(source)}))
        if args.compare_sqlite:
            state = stack.enter_context(tempfile.TemporaryDirectory(prefix="rg-state-cpu-"))
            backends.append(
                ("base-sqlite", ["--state-dir", state], {"PYTHONPATH": _path_with(source)})
            )
    targets, pids = [], {}
    for name, extra, env in backends:
        port = _free_port()
        root = f"http://127.0.0.1:{port}"
        # A gateway of the other checkout runs from it (an editable install of this one
        # would otherwise win over PYTHONPATH's entry for the package).
        cwd = source if "PYTHONPATH" in env else None
        pids[name] = stack.enter_context(
            _process(_serve(model_root, port, *extra), f"{root}/health",
                     env={**admin_env, **env}, cwd=cwd)
        )  # fmt: skip
        targets.append(Target(name, root, pids[name], gateway=True))
    for target in targets:  # warm up every gateway
        asyncio.run(
            _one_round(
                target, pids, rollouts=4, turns=3, context_tokens=1000, tool_chars=50,
                bytes_per_token=bytes_per_token,
            )
        )  # fmt: skip
    return measure_cpu(args, targets, pids, bytes_per_token)


def _report(
    args: argparse.Namespace,
    load_start: float,
    cpu: dict[str, dict[tuple[int, str], RunResult]],
    disk: dict[str, list[dict[str, Any]]],
    restart: dict[str, Any] | None,
) -> None:
    print(
        f"host load {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end on "
        f"{os.cpu_count()} CPUs; {args.rollouts} rollouts x {args.turns} turns per round, "
        f"tool output {args.tool_output_chars} tokens"
    )
    rows: list[tuple[str, str, str, bool]] = []
    for text, cells in cpu.items():
        rows += _report_cpu(args, text, cells)
    for text, figures in disk.items():
        rows += _report_disk(args, text, figures)
    if restart is not None:
        runs = restart["runs"]
        healthy = statistics.median(h for h, _ in runs)
        served = statistics.median(t for _, t in runs if t is not None)
        memory = statistics.median(restart["memory"])
        print(
            f"\nrestart: {args.restart_rollouts} rollouts x {args.restart_turns} turns held "
            f"({restart['bytes'] / 1e6:.1f} MB, written in {restart['fill_s']:.1f} s): "
            f"/health after {healthy:.2f} s, a restored rollout's trajectory (its steps "
            f"loaded) after {served:.2f} s "
            f"(median of {len(runs)}); a memory gateway's /health after {memory:.2f} s"
        )
        rows.append(
            (
                f"restart to serving, {args.restart_rollouts} x {args.restart_turns} held",
                "<= 2 s",
                f"{served:.2f} s",
                served <= 2.0,
            )
        )
    if rows:
        width = max(len(r[0]) for r in rows)
        print(
            f"\ntargets (issue 26), this run:\n  {'':<{width}}  {'target':<10}{'measured':<12}met"
        )
        for name, target, measured, met in rows:
            print(f"  {name:<{width}}  {target:<10}{measured:<12}{'yes' if met else 'NO'}")


def _report_cpu(
    args: argparse.Namespace, text: str, cpu: dict[tuple[int, str], RunResult]
) -> list[tuple[str, str, str, bool]]:
    rows = []
    head = f"{'context':>8}  {'backend':<12}{'turns':>7}{'CPU ms/turn':>13}"
    print(f"\n{text} text\n{head}{'p50 ms':>9}{'p99 ms':>9}")
    per_turn: dict[tuple[int, str], float] = {}
    for (context, name), res in cpu.items():
        n = len(res.latencies_s)
        per_turn[(context, name)] = res.cpu_s[name] * 1000 / n
        print(
            f"{context:>8}  {name:<12}{n:>7}{per_turn[(context, name)]:13.3f}"
            f"{res.pct(0.5):9.2f}{res.pct(0.99):9.2f}"
        )
    print(f"\nratios ({text} text, same run):")
    # (name, its baseline, label): memory against base, each SQLite against memory,
    # SQLite against the other checkout's SQLite.
    pairs = [("base", "memory", "memory/base"), ("base-sqlite", "sqlite", "sqlite/base-sqlite")]
    for context in args.contexts:
        names = [name for (c, name) in per_turn if c == context]
        for name in names:
            if name.startswith("sqlite"):
                pairs.append((name, "memory", f"{name}/memory"))
        for name, other, label in dict.fromkeys(pairs):
            if (context, name) not in per_turn or (context, other) not in per_turn:
                continue
            upper, lower = (other, name) if name.startswith("base") else (name, other)
            ratio = per_turn[(context, upper)] / per_turn[(context, lower)]
            added = cpu[(context, upper)].pct(0.5) - cpu[(context, lower)].pct(0.5)
            added99 = cpu[(context, upper)].pct(0.99) - cpu[(context, lower)].pct(0.99)
            print(
                f"  CPU per turn {label} at {context} tokens, {args.rollouts} rollouts: "
                f"{ratio:.2f}x; latency of {upper} beyond {lower}'s: p50 {added:+.2f} ms, "
                f"p99 {added99:+.2f} ms"
            )
            if label == "sqlite/memory":
                rows.append((f"CPU/turn sqlite/memory, {context} tok, {text} text", "<= 1.15x",
                             f"{ratio:.2f}x", ratio <= 1.15))  # fmt: skip
            if label == "memory/base":
                rows.append((f"CPU/turn memory/base, {context} tok, {text} text", "<= 1.0x",
                             f"{ratio:.2f}x", ratio <= 1.0))  # fmt: skip
    return rows


def _report_disk(
    args: argparse.Namespace, text: str, disk: list[dict[str, Any]]
) -> list[tuple[str, str, str, bool]]:
    rows = []
    for figure in disk:
        context, size, stored = figure["context"], figure["bytes"], figure["stored"]
        per_token = size / stored
        arrays = figure["token_bytes"] / stored
        rest = figure["step_rest"] / stored
        answers = figure["answer_bytes"] / stored
        print(
            f"\ndisk, {text} text, {args.rollouts} rollouts x {args.turns} turns at {context} "
            f"tokens: {size / 1e6:.2f} MB for {stored} stored token ids ({figure['turns']} "
            f"turns): {per_token:.2f} bytes per stored token: token arrays {arrays:.2f} (3 or "
            f"4 per id, 4 per completion logprob), messages, facts and counters {rest:.2f}, "
            f"the last answers {answers:.2f}, pages and indexes "
            f"{per_token - arrays - rest - answers:.2f}"
        )
        rows.append((f"database on disk per stored token, {context} tok, {text} text", "<= 8",
                     f"{per_token:.2f}", per_token <= 8))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
