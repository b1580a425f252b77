"""One verifiers 0.4 (v1) env process of the chaos soak (``benchmarks/soak.py``).

Runs the v1 example (``rollout_gateway.examples.fix_bug_v1``: the same tasks and agent
as the classic example) in gateway mode on contained local sandboxes (the
``local_sandbox`` runtime) against ``--gateway``, ``--concurrency`` episodes at a time,
each one of the env's own ``RunSlot`` episodes (``env.run_slot``, as ``vf-eval`` runs
them), until SIGTERM (then it starts no new episode, lets those running finish up to
``--drain-s`` and exits 0). Run with the v1 stack's interpreter (``rollout-gateway[v1]``):
``soak.py --v1-python PATH`` starts it.

Its journal (``--journal``) is the classic env's (``soak_env.py``): ``start``,
``registering`` (the rollout id, as the control plane is asked to register it), ``end``
(the episode's first typed error, if any, and per recorded step the model's serial and a
digest of its completion ids), so the soak's ledger counts its rollouts with the others.
The steps come from the trajectory the gateway answered the env (read at the env's
control-plane transport, ``GatewayEnvMixin.gateway_transport``): v1's trace keeps the
tokens but not the model's serial. ``--resume`` (after a ``kill -9``) marks what the
journal shows started and not ended ``interrupted`` and unregisters it at the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import random
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_env import (  # noqa: E402
    HOSTILE,
    Journal,
    pick_hostile,
    resume,
    run_until_stopped,
    step_record,
)

#: The journal key of the episode whose requests pass the transport now (set per episode:
#: its tasks inherit it, so the control-plane calls made for it carry it).
_EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("episode", default=None)
_ROLLOUT_PATH = re.compile(r"/v1/rollouts/([^/]+)/(register|trajectory)$")


class LedgerTransport(httpx.AsyncBaseTransport):
    """The env's control-plane transport: journals each registration and keeps, per
    episode, the last trajectory the gateway answered (expanded from the delta form)."""

    def __init__(self, journal: Journal) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.journal = journal
        self.trajectories: dict[str, list[dict[str, Any]]] = {}
        self.rollout_ids: dict[str, str] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = _EPISODE.get()
        found = _ROLLOUT_PATH.search(request.url.path)
        if found and found.group(2) == "register" and key is not None:
            self.journal.write(event="registering", rollout_key=key, rollout_id=found.group(1))
            self.rollout_ids[key] = found.group(1)
        response = await self.inner.handle_async_request(request)
        if found and found.group(2) == "trajectory" and response.status_code == 200:
            from rollout_gateway.protocol import expand_delta_steps

            body = await response.aread()
            answer = json.loads(body)
            steps = answer.get("trajectory") or []
            if answer.get("format") == "delta":
                steps = expand_delta_steps(steps)
            if key is not None:
                self.trajectories[key] = steps
            return httpx.Response(response.status_code, headers=response.headers, content=body)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def hostile_command(hostile: str) -> str:
    """The example harness's command that runs a hostile agent instead of ``agent.py``
    (with this interpreter, which every local sandbox sees, as it runs ``agent.py``)."""
    return f"exec {shlex.quote(sys.executable)} -c {shlex.quote(HOSTILE[hostile])}"


def eval_config(args: argparse.Namespace, hostile: str | None = None) -> Any:
    """The run as v1's ``EvalConfig`` (the v1 demo's, on ``--gateway``); ``hostile``:
    that agent instead of the example's."""
    from rollout_gateway.v1.demo import TASKSET_ID
    from rollout_gateway.v1.eval_internals import EvalConfig

    out = Path(args.journal).resolve().parent
    name = args.name if hostile is None else f"{args.name}-{hostile}"
    agent: dict[str, Any] = {
        # Contained as the classic envs' sandboxes (1 GiB memory and disk each), in a
        # root of its own (what the soak counts as left behind).
        "runtime": {
            "type": "local_sandbox",
            "isolation": "auto",
            "root": args.sandbox_root,
            "memory": 1.0,
            "disk": 1.0,
        },  # fmt: skip
        # The classic envs' agent timeout: what ends an agent that never exits.
        "timeout": {"rollout": args.agent_timeout},
    }
    if hostile is not None:
        agent["harness"] = {"id": TASKSET_ID, "command": hostile_command(hostile)}
    return EvalConfig.model_validate(
        {
            "env": {
                "taskset": {"id": TASKSET_ID},
                "interception": {"type": "gateway", "url": args.gateway, "tunnel": "direct"},
                "agent": agent,
            },
            "model": "scripted",
            "client": {"type": "eval", "base_url": f"{args.gateway}/v1"},
            "sampling": {"max_tokens": 256},
            "select": {"limit": 5},
            "num_rollouts": 1,
            "max_concurrent": args.concurrency,
            "output_dir": str(out),
            "run": {"name": f"soak-{name}", "dir": f"v1-run-{name}"},
            "push": False,
            "rich": None,
        }
    )


def end_line(episode: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The journal's ``end`` fields of a finished episode (plain JSON, as v1 dumps it)."""
    traces = episode.get("traces") or []
    trace = traces[0] if traces else {}
    errors = [*(episode.get("errors") or []), *(trace.get("errors") or [])]
    error = None if episode.get("ok") else (errors[0] if errors else {})
    return {
        "error": None if error is None else str(error.get("type") or "NotOk"),
        "error_message": None if error is None else str(error.get("message", ""))[:300],
        # v1 records every failure as a typed error record; not ok without one is untyped.
        "typed": None if error is None else bool(errors),
        "infra": None,
        "stop": trace.get("stop_condition"),
        "agent_exit": 0 if episode.get("ok") else None,
        "steps": [step_record(s) for s in steps],
    }


class Envs:
    """The example env and one env per hostile agent (v1's harness is the env's), each
    loaded on first use, all sharing the ledger transport; :meth:`serving` serves them."""

    def __init__(self, args: argparse.Namespace, transport: LedgerTransport) -> None:
        self.args = args
        self.transport = transport
        # Read now: the first env's gateway client takes it out of this process's
        # environment (so that no agent inherits it).
        self.admin_token = os.environ["ROLLOUT_GATEWAY_ADMIN_TOKEN"]
        self.stack = contextlib.AsyncExitStack()
        self.loaded: dict[str | None, tuple[Any, list[Any]]] = {}
        self.config = eval_config(args)

    async def get(self, hostile: str | None) -> tuple[Any, list[Any]]:
        """The env running ``hostile`` (``None``: the example agent) and its tasks."""
        from rollout_gateway.v1.eval_internals import load_environment

        if hostile not in self.loaded:
            config = eval_config(self.args, hostile)
            env = load_environment(config.env)
            env.gateway_admin_token = self.admin_token
            env.gateway_transport = self.transport
            await self.stack.enter_async_context(env.serving())
            self.loaded[hostile] = (env, list(env.taskset.select(config.select)))
        return self.loaded[hostile]


async def run(args: argparse.Namespace) -> int:
    from rollout_gateway.v1.demo import V1Stack
    from rollout_gateway.v1.eval_internals import ModelContext

    journal = Journal(Path(args.journal))
    if args.resume:
        await resume(args, journal)
    transport = LedgerTransport(journal)
    envs = Envs(args, transport)
    config = envs.config
    ctx = ModelContext(client=config.client, model=config.model, sampling=config.sampling)
    rng = random.Random(f"{args.seed}:{args.name}:{os.getpid()}")
    start_key = f"{args.name}:{os.getpid()}"

    async def one(seq: int) -> None:
        key = f"{start_key}:{seq}"
        _EPISODE.set(key)  # this task's context: the transport sees it
        hostile = pick_hostile(rng, args.hostile_share)
        journal.write(event="start", rollout_key=key, env=args.name, hostile=hostile)
        started = time.monotonic()
        try:
            env, tasks = await envs.get(hostile)
            slot = env.slots(tasks[seq % len(tasks)], 1)[0]
            episode = await env.run_slot(slot, ctx, None)
        except asyncio.CancelledError:
            journal.write(event="cancelled", rollout_key=key, env=args.name, hostile=hostile)
            raise
        except Exception as exc:  # what run_slot lets escape: journalled, untyped
            journal.write(
                event="end", rollout_key=key, env=args.name, hostile=hostile, rollout_id=None,
                error=type(exc).__name__, error_message=str(exc)[:300], typed=False,
                escaped=True, steps=[], seconds=round(time.monotonic() - started, 3),
            )  # fmt: skip
            return
        dumped = json.loads(V1Stack.dump(episode))
        steps = transport.trajectories.pop(key, [])
        journal.write(
            event="end", rollout_key=key, env=args.name, hostile=hostile,
            rollout_id=transport.rollout_ids.pop(key, None),
            seconds=round(time.monotonic() - started, 3), **end_line(dumped, steps),
        )  # fmt: skip

    async with envs.stack:
        await envs.get(None)
        late = await run_until_stopped(one, args.concurrency, args.drain_s)
        for task in late:  # past --drain-s: cancelled (journalled), v1 cleans up
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    await transport.aclose()
    journal.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", required=True, help="the gateway root URL (HAProxy's)")
    parser.add_argument("--name", required=True, help="this env's name in the journal")
    parser.add_argument("--journal", required=True)
    parser.add_argument("--sandbox-root", required=True)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--drain-s", type=float, default=120.0)
    parser.add_argument("--resume", action="store_true", help="after a kill: see the doc")
    parser.add_argument("--hostile-share", type=float, default=0.0)
    parser.add_argument("--agent-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
