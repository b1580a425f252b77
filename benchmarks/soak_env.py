"""One env process of the chaos soak (``benchmarks/soak.py`` starts and kills these).

Runs the example env (``rollout_gateway.examples.fix_bug_env``, verifiers 0.3, gateway
mode) on contained local sandboxes against ``--gateway`` (HAProxy in front of the
gateways, or one gateway), ``--concurrency`` rollouts at a time, until SIGTERM (then it
starts no new rollout, lets those running finish, tears the env down and exits 0).

A share of the rollouts (``--hostile-share``) runs a hostile agent instead of the
example's (``HOSTILE``): a memory hog, a fork bomb, a retry storm after a refusal,
oversized bodies, an agent that never exits.

Every rollout is journalled (``--journal``, JSON lines, flushed at once): a ``start``
line before it runs, an ``end`` line with its outcome: the typed error (if any), the
stop condition, the agent's exit code and, per recorded step, the model's serial of the
completion (``extras.usage.call``, see ``scripted/faults.py``) and a digest of its
completion ids, which the soak's ledger check compares with what the model served.
``--resume`` (after a ``kill -9``): the rollouts the journal shows started and not ended
get an ``interrupted`` line and run again as new rollouts; the sandboxes the dead process
left in ``--sandbox-root`` are removed by the new local sandbox client (stale sweep).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

#: The start of an agent program that posts chat bodies to its rollout: ``post(body)``
#: returns the answer's status (0: no answer).
_POST = (
    "import json, os, urllib.request, urllib.error\n"
    "base = os.environ['OPENAI_BASE_URL'].rstrip('/')\n"
    "key = os.environ['OPENAI_API_KEY']\n"
    "def post(body):\n"
    "    req = urllib.request.Request(base + '/chat/completions', data=body,\n"
    "        headers={'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'})\n"
    "    try:\n"
    "        return urllib.request.urlopen(req, timeout=60).status\n"
    "    except urllib.error.HTTPError as e:\n"
    "        return e.code\n"
    "    except OSError:\n"
    "        return 0\n"
)

#: Hostile agents (``agent.py`` replaced): each must end with the sandbox deleted, the
#: rollout unregistered and one typed error (or a clean stop), nothing left behind.
HOSTILE: dict[str, str] = {
    # Grows until the sandbox's memory limit kills it.
    "memory_hog": "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n",
    # Forks until the sandbox's process limit refuses; the children linger a while.
    "fork_bomb": (
        "import os, time\n"
        "for _ in range(100000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5)\n"
        "            os._exit(0)\n"
        "    except OSError:\n"
        "        break\n"
        "time.sleep(5)\n"
    ),
    # One turn, then a bad request refused, then the same refused request 300 times.
    "retry_storm": (
        _POST + "ok = json.dumps({'model': os.environ.get('OPENAI_MODEL', 'm'), 'messages': [\n"
        "    {'role': 'user', 'content': '<script>[{\"say\": \"hi\"}]</script>'}]}).encode()\n"
        "post(ok)\n"
        "for _ in range(300):\n"
        "    post(b'{not json')\n"
    ),
    # A 20 MiB body (refused at the intake), then one ordinary turn.
    "oversized": (
        _POST + "big = json.dumps({'model': 'm',\n"
        "    'messages': [{'role': 'user', 'content': 'x' * (20 << 20)}]})\n"
        "post(big.encode())\n"
        "post(json.dumps({'model': 'm', 'messages': [\n"
        "    {'role': 'user', 'content': '<script>[{\"say\": \"done\"}]</script>'}]}).encode())\n"
    ),
    # Never exits: the agent timeout stops it.
    "never_exits": "import time\nwhile True:\n    time.sleep(3600)\n",
}


def pick_hostile(rng: random.Random, share: float) -> str | None:
    """The hostile agent a rollout runs (``None``: the example agent), ``share`` of them."""
    return rng.choice(sorted(HOSTILE)) if rng.random() < share else None


def _soak_env_class() -> Any:
    from rollout_gateway.examples.fix_bug_env import env as fix_bug

    class SoakEnv(fix_bug.FixBugEnv):
        """The example env; a rollout whose ``info["hostile"]`` names one runs that agent.
        Each rollout's id is journalled before it registers (so a resumed env can
        unregister what a killed one left)."""

        journal: Journal

        async def register_rollout(self, state: Any) -> None:
            self.journal.write(
                event="registering", rollout_key=state["info"]["soak_key"],
                rollout_id=state["rollout_id"],
            )  # fmt: skip
            await super().register_rollout(state)

        async def post_sandbox_setup(self, state: Any) -> None:
            await super().post_sandbox_setup(state)
            hostile = state["info"].get("hostile")
            if hostile:
                command = fix_bug.bundle_command({"agent.py": HOSTILE[hostile]}, self.task_dir)
                await self.sandbox_client.execute_command(state["sandbox_id"], command, timeout=60)

        async def post_rollout(self, state: Any) -> None:
            if state["info"].get("hostile"):
                state["tests_passed"] = False
                return
            await super().post_rollout(state)

    return SoakEnv


def step_record(step: Any) -> dict[str, Any]:
    """What the ledger check needs of a recorded step: the model's serial and a digest."""
    from rollout_gateway.scripted.faults import completion_digest

    extras = step.get("extras") or {}
    usage = extras.get("usage") or {}
    tokens = step.get("tokens") or {}
    ids = list(tokens.get("completion_ids") or [])
    return {"call": usage.get("call"), "digest": completion_digest(ids), "n": len(ids)}


class Journal:
    """The env's JSON-lines journal (each line flushed and synced: a kill -9 keeps it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, **line: Any) -> None:
        line["at"] = time.time()
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def interrupted(path: Path) -> dict[str, str | None]:
    """Rollouts the journal shows started and neither ended nor marked interrupted, with
    the rollout id each registered (``None``: killed before it registered)."""
    open_ids: dict[str, str | None] = {}
    if not path.exists():
        return {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        key = line.get("rollout_key")
        if line.get("event") == "start":
            open_ids[key] = None
        elif line.get("event") == "registering" and key in open_ids:
            open_ids[key] = line.get("rollout_id")
        elif line.get("event") in ("end", "interrupted"):
            open_ids.pop(key, None)
    return open_ids


async def unregister_left(gateway: str, rollout_ids: list[str]) -> int:
    """Unregister the rollouts a killed predecessor left registered (as a trainer resuming
    would); how many the gateway still held."""
    import httpx

    admin = {"Authorization": f"Bearer {os.environ['ROLLOUT_GATEWAY_ADMIN_TOKEN']}"}
    held = 0
    async with httpx.AsyncClient(base_url=gateway, headers=admin, timeout=30) as client:
        for rollout_id in rollout_ids:
            for _ in range(30):  # through a gateway restart or an outage
                try:
                    answer = await client.post(f"/v1/rollouts/{rollout_id}/unregister")
                except httpx.HTTPError:
                    await asyncio.sleep(1.0)
                    continue
                if answer.status_code < 500:
                    held += answer.status_code == 200
                    break
                await asyncio.sleep(1.0)
    return held


async def resume(args: argparse.Namespace, journal: Journal) -> None:
    """After a ``kill -9`` (``--resume``): journal the rollouts the dead process left
    started and not ended as ``interrupted`` and unregister them at the gateway (they run
    again as new rollouts)."""
    left = interrupted(Path(args.journal))
    for key, rollout_id in left.items():
        journal.write(event="interrupted", rollout_key=key, env=args.name, rollout_id=rollout_id)
    held = await unregister_left(args.gateway, [i for i in left.values() if i])
    journal.write(event="resumed", interrupted=len(left), unregistered=held)


async def run_until_stopped(
    run_one: Callable[[int], Awaitable[None]], concurrency: int, drain_s: float
) -> set[asyncio.Task[None]]:
    """``run_one(0)``, ``run_one(1)``, ... at most ``concurrency`` at once until SIGTERM
    or SIGINT; then no new one starts and those running get ``drain_s`` seconds to end.
    Returns those still running then (the caller stops them)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    limit = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()

    async def slot(seq: int) -> None:
        try:
            await run_one(seq)
        finally:
            limit.release()

    for seq in itertools.count():
        acquire = asyncio.ensure_future(limit.acquire())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({acquire, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if stop.is_set():
            if acquire.done():
                limit.release()
            else:
                acquire.cancel()
            break
        task = asyncio.create_task(slot(seq))  # in a copy of this context (contextvars)
        running.add(task)
        task.add_done_callback(running.discard)
    if not running:
        return set()
    _, late = await asyncio.wait(running, timeout=drain_s)
    return late


def _soak_env(args: argparse.Namespace, sandboxes: Any, journal: Journal) -> Any:
    """The example env on ``sandboxes``, in gateway mode against ``--gateway``."""
    from rollout_gateway.examples.fix_bug_env.tasks import build_dataset

    env = _soak_env_class()(
        dataset=build_dataset(5),
        sandbox_client=sandboxes,
        gateway={
            "gateway_url": args.gateway,
            "tunnel_provider": "direct",
            "admin_token": os.environ["ROLLOUT_GATEWAY_ADMIN_TOKEN"],
            "agent_timeout": args.agent_timeout,
            # Through a gateway restart or a short outage (about 35 s of retries).
            "retry": {"max_attempts": 12, "max_backoff": 5.0},
        },
        timeout_seconds=args.agent_timeout + 60,
        sandbox_creations_per_minute=None,
        max_retries=0,
        agent_setup_command=None,  # the local backend runs the host's Python (openai there)
        memory_gb=1,  # the memory hog is stopped at 1 GiB (2 shared cores, several hogs)
        disk_size_gb=1,
    )
    env.journal = journal
    return env


def _rollout_input(
    row: dict[str, Any], example_id: int, key: str, hostile: str | None
) -> dict[str, Any]:
    """The rollout's input: the dataset row, its agent (``hostile``) and journal key."""
    data: dict[str, Any] = {k: row[k] for k in ("prompt", "answer", "info") if k in row}
    data["info"] = {**data["info"], "hostile": hostile, "soak_key": key}
    data["example_id"] = example_id
    return data


def end_fields(state: Any) -> dict[str, Any]:
    """The journal's ``end`` fields of a finished classic rollout."""
    import verifiers as vf

    error = state.get("error")
    return {
        "rollout_id": state.get("rollout_id"),
        "sandbox_id": state.get("sandbox_id"),
        "error": type(error).__name__ if error is not None else None,
        "error_message": str(error)[:300] if error is not None else None,
        "infra": isinstance(error, vf.InfraError) if error is not None else None,
        "typed": isinstance(error, vf.Error) if error is not None else None,
        "stop": state.get("stop_condition"),
        "agent_exit": state.get("agent_exit_code"),
        "tests_passed": state.get("tests_passed"),
        "steps": [step_record(s) for s in state.get("trajectory") or []],
    }


async def run(args: argparse.Namespace) -> int:
    import verifiers as vf
    from openai import AsyncOpenAI

    from rollout_gateway.local_sandbox import LocalSandboxClient

    journal = Journal(Path(args.journal))
    if args.resume:
        await resume(args, journal)
    rng = random.Random(f"{args.seed}:{args.name}:{os.getpid()}")
    sandboxes = LocalSandboxClient(root=args.sandbox_root)  # sweeps a dead process's left-overs
    env = _soak_env(args, sandboxes, journal)
    client = vf.OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url=f"{args.gateway}/v1", api_key="soak", max_retries=0)
    )
    rows = list(env.get_dataset(n=5))
    start_key = f"{args.name}:{os.getpid()}"

    async def one(seq: int) -> None:
        hostile = pick_hostile(rng, args.hostile_share)
        key = f"{start_key}:{seq}"
        data = _rollout_input(rows[seq % len(rows)], seq % len(rows), key, hostile)
        journal.write(event="start", rollout_key=key, env=args.name, hostile=hostile)
        started = time.monotonic()
        try:
            state = await env.rollout(data, client, "scripted", {"max_tokens": 256})
        except asyncio.CancelledError:
            # Still running past --drain-s at the stop: the env's teardown cancelled it
            # (it finalized: cancelled and unregistered at the gateway, sandbox deleted).
            journal.write(
                event="cancelled", rollout_key=key, env=args.name, hostile=hostile,
                seconds=time.monotonic() - started,
            )  # fmt: skip
            raise
        except Exception as exc:  # only configuration errors escape rollout(): journalled
            journal.write(
                event="end", rollout_key=key, env=args.name, hostile=hostile, rollout_id=None,
                error=type(exc).__name__, infra=False, escaped=True, stop=None, steps=[],
                seconds=time.monotonic() - started,
            )  # fmt: skip
            return
        journal.write(
            event="end", rollout_key=key, env=args.name, hostile=hostile,
            seconds=round(time.monotonic() - started, 3), **end_fields(state),
        )  # fmt: skip

    try:
        # Those still running past --drain-s are left to the env's teardown, which
        # cancels them (each then finalizes: cancelled at the gateway, sandbox deleted).
        await run_until_stopped(one, args.concurrency, args.drain_s)
    finally:
        await env._teardown()
        sandboxes.teardown()
        journal.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", required=True, help="the gateway root URL (HAProxy's)")
    parser.add_argument("--name", required=True, help="this env's name in the journal")
    parser.add_argument("--journal", required=True)
    parser.add_argument("--sandbox-root", required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--hostile-share", type=float, default=0.1)
    parser.add_argument("--agent-timeout", type=float, default=60.0)
    parser.add_argument("--drain-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="after a kill: see the doc")
    args = parser.parse_args()
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
