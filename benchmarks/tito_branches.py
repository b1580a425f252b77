"""Branches per rollout, chat mode vs token-in mode, on the same multi-turn tool task.

The gateway (in-process, real code path) sits in front of a real vLLM started with
``--enable-scale-out`` (``tools/real-vllm``: ``VLLM_EXTRA_ARGS=--enable-scale-out bash
serve.sh DEST 8021``). For each mode, the same scripted agent drives the same rollouts
(same seeds): a history that already holds an assistant tool call and its result, tool
results appended after every call the model makes, a user follow-up otherwise. Each
rollout's recorded trajectory is rebuilt into a verifiers v1 ``Trace`` with the adapter's
``TraceSync`` (what the v1 env does in gateway mode), and its ``trace.branches`` counted:
one branch = one training sample holding every turn; more = context repeated per sample.

Run in the v1 venv (verifiers 0.4 + the ``[tito]`` extra)::

    python benchmarks/tito_branches.py --upstream http://127.0.0.1:8021/v1

``--tokenizer`` defaults to the model directory ``/v1/models`` reports; ``--renderer``
to the template-bridge renderer for the recipe's Gemma 3 template.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.task import TaskData
from verifiers.v1.trace import AgentInfo, TraceTask

from rollout_gateway.cli import served_model_path
from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.v1.trace_sync import TraceSync

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
from support.tools import RUN_SHELL_TOOL, run_shell_call  # noqa: E402

ADMIN = "tito-benchmark-admin-token-0123456789"
TOOLS = [RUN_SHELL_TOOL]


# The history the agent starts from: it has already called the tool twice (the 270M base
# model then writes calls itself now and then).
START = [
    {"role": "system", "content": "You are a careful assistant with a shell."},
    {"role": "user", "content": "Find the bug in this project. List the files first."},
    run_shell_call("call_0", "ls"),
    {"role": "tool", "tool_call_id": "call_0", "content": "main.py\nutils.py\nREADME.md"},
    run_shell_call("call_1", "cat main.py"),
    {"role": "tool", "tool_call_id": "call_1", "content": "import utils\nprint(utils.add(1, 2))"},
]


def tool_output(call: dict[str, Any]) -> str:
    """The scripted shell: a fixed answer per command."""
    try:
        command = json.loads(call["function"]["arguments"]).get("command", "")
    except (ValueError, AttributeError):
        command = ""
    return f"$ {command}\ndef add(a, b):\n    return a - b\n"


async def run_rollout(
    client: httpx.AsyncClient, rollout_id: str, model: str, seed: int, turns: int, max_tokens: int
) -> dict[str, Any]:
    """One rollout through the gateway; its trajectory and what the model did."""
    sampling = {"temperature": 0.8, "seed": seed, "max_tokens": max_tokens}
    r = await client.post(
        f"/v1/rollouts/{rollout_id}/register",
        json={"model": model, "sampling_params": sampling, "max_turns": -1},
    )
    r.raise_for_status()
    key = r.json()["api_key"]
    messages = [dict(m) for m in START]
    model_calls = 0
    started = time.perf_counter()
    for turn in range(turns):
        r = await client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": messages, "tools": TOOLS},
            headers={"Authorization": f"Bearer {key}"},
        )
        r.raise_for_status()
        message = r.json()["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        echoed = {"role": "assistant", "content": message.get("content") or ""}
        if calls:
            echoed["tool_calls"] = calls
        messages.append(echoed)
        if calls:
            model_calls += len(calls)
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": tool_output(c)} for c in calls
            ]
        else:
            messages.append({"role": "user", "content": f"Run a command to check ({turn + 1})."})
    seconds = time.perf_counter() - started
    r = await client.get(f"/v1/rollouts/{rollout_id}/trajectory")
    r.raise_for_status()
    trajectory = r.json()
    await client.post(f"/v1/rollouts/{rollout_id}/unregister")
    return {"trajectory": trajectory, "model_calls": model_calls, "seconds": seconds}


def branches(trajectory: dict[str, Any], model: str) -> tuple[int, int, int]:
    """(branches, trainable branches, turns) of the v1 trace rebuilt from a trajectory."""
    trace = vf.Trace(
        task=TraceTask(type="tito", data=TaskData(prompt="tito")),
        agent=AgentInfo(config=AgentConfig(model=model)),
    )
    TraceSync(trace, model=model, sampling=None, rollout_id="tito").apply(trajectory["trajectory"])
    found = trace.branches
    return len(found), sum(1 for b in found if b.trainable), trace.num_turns


async def run_mode(args: argparse.Namespace, mode: str) -> list[dict[str, Any]]:
    config = GatewayConfig.from_fields(
        upstreams=[args.upstream],
        admin_token=ADMIN,
        upstream_mode=mode,
        tokenizer=args.tokenizer if mode == "token-in" else None,
        renderer=args.renderer,
        upstream_timeout_s=900,
    )
    app = create_app(config)
    rows = []
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(app.router.lifespan_context(app))
        client = await stack.enter_async_context(
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app),
                base_url="http://gateway",
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=900,
            )
        )
        for i in range(args.rollouts):
            out = await run_rollout(
                client, f"{mode}-{i}", args.model, args.seed + i, args.turns, args.max_tokens
            )
            steps = out["trajectory"]["trajectory"]
            n, trainable, turns = branches(out["trajectory"], args.model)
            rows.append(
                {
                    "branches": n,
                    "trainable": trainable,
                    "turns": turns,
                    "prefix_breaks": sum(1 for s in steps if s["extras"].get("prefix_break")),
                    "bridged": sum(1 for s in steps if s["extras"].get("bridged")),
                    "cut": sum(1 for s in steps if s["extras"].get("finish_reason") == "length"),
                    "model_calls": out["model_calls"],
                    "seconds": out["seconds"],
                }
            )
            print(f"  {mode:8} rollout {i}: {rows[-1]}", flush=True)
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", default="http://127.0.0.1:8021/v1")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokenizer", default=None, help="default: the model dir /models reports")
    parser.add_argument(
        "--renderer", default="rollout_gateway.server.template_bridge:end_of_turn_pythonic"
    )
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    args.upstream = args.upstream.rstrip("/")
    args.tokenizer = args.tokenizer or served_model_path(args.upstream)
    if args.tokenizer is None:
        raise SystemExit("--tokenizer: the upstream's /v1/models names no local model directory")
    results = {mode: await run_mode(args, mode) for mode in ("chat", "token-in")}
    print(
        f"\nbranches per rollout, {args.rollouts} rollouts x {args.turns} turns, "
        f"max_tokens {args.max_tokens}, same seeds per mode ({args.model} at {args.upstream})"
    )
    header = ("mode", "branches", "trainable", "mean", "prefix breaks", "bridged", "cut", "calls")
    print("{:9} {:>14} {:>14} {:>6} {:>14} {:>8} {:>5} {:>6}".format(*header))
    for mode, rows in results.items():
        print(
            "{:9} {:>14} {:>14} {:>6.2f} {:>14} {:>8} {:>5} {:>6}".format(
                mode,
                str([r["branches"] for r in rows]),
                str([r["trainable"] for r in rows]),
                statistics.mean(r["branches"] for r in rows),
                sum(r["prefix_breaks"] for r in rows),
                sum(r["bridged"] for r in rows),
                sum(r["cut"] for r in rows),
                sum(r["model_calls"] for r in rows),
            )
        )
    chat = statistics.mean(r["branches"] for r in results["chat"])
    tito = statistics.mean(r["branches"] for r in results["token-in"])
    print(f"\nbranches per rollout, chat / token-in: {chat / tito:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
