"""The demo on verifiers 0.4 (``rollout-gateway[v1]``): :class:`V1Stack`.

Runs the v1 example (:mod:`rollout_gateway.examples.fix_bug_v1`, taskset id
``rollout-gateway-fix-bug-v1``) through v1's own eval machinery, in gateway mode: the
env is loaded from a resolved ``EvalConfig`` as ``vf-eval`` loads it, each rollout is
one of the env's ``RunSlot`` episodes, its agent contained in a local sandbox (the
``local_sandbox`` runtime, :class:`rollout_gateway.v1.LocalSandboxRuntime`), and on
``--resume`` v1's own planner decides what runs again (episodes not ``ok`` are owed).
The run directory is a v1 run directory:

- ``configs/resolved/eval.json``: the resolved config, so ``vf-eval @ DIR/configs/resolved/eval.json
  --resume`` continues the run (against a gateway at the address it names), and
  ``vf-replay DIR --no-rich`` reads it (re-scoring nothing of the example's: its reward
  needs the rollout's sandbox; see docs/demo.md);
- ``traces.jsonl``: one episode per line as each finishes, floats at full precision
  (v1's writer rounds per-token logprobs to 4 decimals; a trainer reads this file);
- ``logs/attempt_<n>/eval.log`` (``logs/latest``): the env's and the gateway adapter's logs;
- ``metadata.json``: the demo's record (settings, status, counts, resumes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import itertools
import json
import logging
import uuid
from pathlib import Path
from typing import Any

from rollout_gateway.demo.stack import DemoStack, RolloutSummary, StackSetup, WorkItem
from rollout_gateway.demo.threads import off_loop
from rollout_gateway.v1.eval_internals import (
    EvalConfig,
    EvalRunInfo,
    ModelContext,
    create_attempt_log_dir,
    eval_resume,
    load_environment,
    plan_rollouts,
    type_adapter,
    write_config,
)

TRACES_FILE = "traces.jsonl"
#: The example's taskset id (:mod:`rollout_gateway_fix_bug_v1`).
TASKSET_ID = "rollout-gateway-fix-bug-v1"
#: Per-token floats written at full precision (v1's ``RECORD_FLOAT_DECIMALS`` otherwise).
FULL_PRECISION = {"float_decimals": None}
_MODULES = (
    "verifiers.v1",
    # Loading an env by id imports these packages (every built-in taskset, harness, env:
    # seconds), on the event loop unless they are imported here first.
    "verifiers.v1.tasksets",
    "verifiers.v1.harnesses",
    "verifiers.v1.envs",
    "verifiers.v1.cli.output",
    "verifiers.v1.configs.cli.eval",
    "verifiers.v1.utils.loaders",
    "rollout_gateway.v1",
    "rollout_gateway.examples.fix_bug_v1",
    "rollout_gateway_fix_bug_v1",
)
_LOGGERS = ("verifiers", "rollout_gateway")


def runtime_config(isolation: str, read_only: list[str] | None = None) -> dict[str, Any]:
    """The ``[env.agent.runtime]`` block the example's agents run on: a contained local
    sandbox (:class:`rollout_gateway.v1.LocalSandboxRuntime`) in the isolation mode
    preflight resolved, so a resumed run is contained as the run was; ``read_only``: host
    directories each sandbox sees (a real CLI's install, ``--agent``)."""
    config: dict[str, Any] = {"type": "local_sandbox", "isolation": isolation}
    if read_only:
        config["read_only"] = read_only
    return config


def agent_config(setup: StackSetup) -> dict[str, Any]:
    """The ``[env.agent]`` block: the runtime, and with ``--agent`` a real CLI as the
    example harness's command (it runs where ``agent.py`` would, on the same task)."""
    agent = setup.agent
    if agent is None:
        return {"runtime": runtime_config(setup.isolation)}
    return {
        "runtime": runtime_config(setup.isolation, agent.read_only),
        "harness": {"id": TASKSET_ID, "command": agent.command()},
    }


# ---------------------------------------------------------------- reading a run directory


def _episode_summary(episode: dict[str, Any], rollout_index: int) -> RolloutSummary:
    """The demo's view of one stored episode (plain JSON: no verifiers import)."""
    traces = episode.get("traces") or []
    trace = traces[0] if traces else {}
    task = (trace.get("task") or episode.get("task") or {}).get("data") or {}
    rewards = trace.get("rewards") or {}
    reward = sum(
        float(r.get("score") or 0.0) * float(r.get("weight", 1.0))
        for r in rewards.values()
        if isinstance(r, dict)
    )
    errors = [*(episode.get("errors") or []), *(trace.get("errors") or [])]
    timing = trace.get("timing") or {}
    scoring_end = float((timing.get("scoring") or {}).get("end") or 0.0)
    start = float(timing.get("start") or 0.0)
    error = None
    if not episode.get("ok"):
        shown = [f"{e.get('type', 'Error')}: {e.get('message', '')}".strip() for e in errors]
        stop = trace.get("stop_condition")
        error = "; ".join(shown) or f"not ok (stop: {stop})"
    return RolloutSummary(
        example_id=int(task.get("idx") or 0),
        rollout_index=rollout_index,
        task=str(task.get("name") or task.get("id") or "?"),
        reward=reward,
        turns=sum(1 for n in trace.get("nodes") or [] if n.get("sampled")),
        # What the trace itself counts (its computed num_input/num_output_tokens).
        input_tokens=int(trace.get("num_input_tokens") or 0),
        output_tokens=int(trace.get("num_output_tokens") or 0),
        seconds=round(scoring_end - start, 3) if scoring_end and start else 0.0,
        error=error,
    )


#: Where each trace of a demo episode notes the rollout index it ran as.
ROLLOUT_INDEX_KEY = "demo_rollout_index"


def _rollout_index(episode: dict[str, Any]) -> int | None:
    for trace in episode.get("traces") or []:
        index = (trace.get("info") or {}).get(ROLLOUT_INDEX_KEY)
        if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
            return index
    return None


def number_rollouts(recorded: list[int | None], more: int) -> tuple[list[int], list[int]]:
    """The rollout indexes of one task's stored episodes (their recorded ones; an episode
    without one, from an older run, or a repeat, takes the lowest free index) and of
    ``more`` new rollouts (the lowest indexes still free)."""
    taken: set[int] = set()
    stored: list[int | None] = []
    for index in recorded:
        if index is not None and index not in taken:
            taken.add(index)
            stored.append(index)
        else:
            stored.append(None)
    free = (n for n in itertools.count() if n not in taken)
    stored_indexes = [index if index is not None else next(free) for index in stored]
    return stored_indexes, [next(free) for _ in range(more)]


def read_episodes(run_dir: Path) -> list[dict[str, Any]]:
    """The episodes of ``traces.jsonl``; torn or malformed lines are left out."""
    try:
        lines = (run_dir / TRACES_FILE).read_bytes().splitlines()
    except FileNotFoundError:
        return []
    episodes = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("traces"), list):
            episodes.append(row)
    return episodes


class V1Stack(DemoStack):
    """The demo's verifiers 0.4 part (see the module docstring).

    Attributes:
        gateway_transport: httpx transport of the env's control-plane clients (tests
            read the trajectories the gateway answered through it).
    """

    name = "v1"
    env_id = TASKSET_ID
    gateway_transport: Any = None

    def __init__(self) -> None:
        self._env: Any = None
        self._ctx: Any = None
        self._config: Any = None
        self._setup: StackSetup | None = None
        self._rewards: list[float] = []

    def stored(self, run_dir: Path) -> list[RolloutSummary]:
        episodes = read_episodes(run_dir)
        summaries = [_episode_summary(episode, 0) for episode in episodes]
        by_task: dict[int, list[int]] = {}
        for position, summary in enumerate(summaries):
            by_task.setdefault(summary.example_id, []).append(position)
        for positions in by_task.values():
            recorded = [_rollout_index(episodes[p]) for p in positions]
            for p, index in zip(positions, number_rollouts(recorded, 0)[0], strict=True):
                summaries[p] = dataclasses.replace(summaries[p], rollout_index=index)
        return summaries

    async def prepare(self) -> None:
        for module in _MODULES:
            await off_loop(importlib.import_module, module)

    # ---------------------------------------------------------------- the run

    def eval_config(self, setup: StackSetup) -> Any:
        """The run as v1's ``EvalConfig`` (what ``vf-eval`` would have resolved)."""
        opts = setup.options
        run_dir = setup.run_dir.resolve()
        return EvalConfig.model_validate(
            {
                "env": {
                    "taskset": {"id": TASKSET_ID},
                    "interception": {
                        "type": "gateway",
                        "url": setup.gateway_url,
                        "tunnel": "direct",
                    },
                    "agent": agent_config(setup),
                },
                "model": setup.model,
                "client": {"type": "eval", "base_url": f"{setup.gateway_url}/v1"},
                "sampling": {"temperature": opts.temperature, "max_tokens": opts.max_tokens},
                "select": {"limit": opts.examples},
                "num_rollouts": opts.rollouts_per_example,
                "max_concurrent": opts.concurrency,
                "output_dir": str(run_dir.parent),
                "run": {"name": f"demo-{TASKSET_ID}-{setup.model}", "dir": run_dir.name},
                "push": False,
                "rich": None,
            }
        )

    async def start(self, setup: StackSetup, stack: contextlib.AsyncExitStack) -> list[WorkItem]:
        self._setup = setup
        # Resolving the config and building the env and its tasks is seconds of pydantic
        # work the first time: off the event loop, so that a signal stops setup at once.
        config, env, tasks = await off_loop(self._build, setup)
        self._config, self._env = config, env
        config.run.assign_id(uuid.uuid4().hex)
        write_config(config, setup.run_dir)  # a resume names this attempt's addresses
        traces = setup.run_dir / TRACES_FILE
        if not setup.resuming:
            traces.write_text("")
        self._log_to(create_attempt_log_dir(setup.run_dir) / "eval.log", stack)

        if setup.resuming:
            # v1's own loader and planner, as vf-eval --resume: episodes not kept (by the
            # env's verdict, ok; all with --keep-failed) are dropped from traces.jsonl
            # and owed again.
            keep = (lambda episode: True) if setup.keep_failed else env.complete
            plan = eval_resume.load(setup.run_dir, tasks, config.num_rollouts, keep)
        else:
            plan = plan_rollouts(tasks, config.num_rollouts)
        self._rewards = [s.reward for s in self.stored(setup.run_dir)]
        await stack.enter_async_context(env.serving())
        self._ctx = ModelContext(client=config.client, model=config.model, sampling=config.sampling)
        items = []
        for task, kept, owed in plan:
            recorded = [
                _rollout_index({"traces": [{"info": t.info} for t in episode.traces]})
                for episode in kept
            ]
            for index in number_rollouts(recorded, owed)[1]:
                items.append(WorkItem(task.data.idx, index, env.slots(task, 1)[0]))
        return items

    def _build(self, setup: StackSetup) -> tuple[Any, Any, list[Any]]:
        """The resolved config, the env (not serving yet) and the tasks it runs."""
        config = self.eval_config(setup)
        env = load_environment(config.env)
        env.gateway_admin_token = setup.admin_token  # never through the environment
        env.gateway_transport = self.gateway_transport
        return config, env, list(env.taskset.select(config.select))

    def _log_to(self, path: Path, stack: contextlib.AsyncExitStack) -> None:
        """The attempt's ``eval.log``: v1's and the adapter's logs (as vf-eval tees them)."""
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        verbose = self._setup is not None and self._setup.options.verbose
        handler.setLevel(logging.DEBUG if verbose else logging.INFO)
        for name in _LOGGERS:
            logging.getLogger(name).addHandler(handler)

        def close() -> None:
            for name in _LOGGERS:
                logging.getLogger(name).removeHandler(handler)
            handler.close()

        stack.callback(close)

    async def run(self, item: WorkItem, limit: asyncio.Semaphore) -> RolloutSummary:
        persist = functools.partial(self._persist, item.rollout_index)
        episode = await self._env.run_slot(item.handle, self._ctx, limit, persist)
        summary = _episode_summary(json.loads(self.dump(episode)), item.rollout_index)
        self._rewards.append(summary.reward)
        return summary

    async def _persist(self, rollout_index: int, episode: Any) -> None:
        """v1's persistence hook (``on_complete``): one line, whole, before anything else.
        Its traces note the rollout index it ran as (``info["demo_rollout_index"]``), so a
        re-read run numbers its rollouts as the live table did."""
        assert self._setup is not None and self._config is not None
        episode.record_run(EvalRunInfo(id=self._config.run.id, name=self._config.run.name))
        for trace in episode.traces:
            trace.info[ROLLOUT_INDEX_KEY] = rollout_index
        with (self._setup.run_dir / TRACES_FILE).open("ab") as f:
            f.write(self.dump(episode) + b"\n")

    @staticmethod
    def dump(episode: Any) -> bytes:
        """An episode as ``traces.jsonl`` holds it: v1's serialization (typed subclass
        fields kept, nulls left out), per-token floats at full precision."""
        return bytes(
            type_adapter(type(episode)).dump_json(
                episode, exclude_none=True, context=FULL_PRECISION
            )
        )

    def metadata(self) -> dict[str, Any]:
        if self._config is None:
            return {}
        config = self._config
        rewards = self._rewards
        return {
            "base_url": config.client.base_url,
            "num_examples": config.select.limit,
            "rollouts_per_example": config.num_rollouts,
            "sampling_args": config.sampling.model_dump(exclude_none=True),
            "avg_reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "run_config": "configs/resolved/eval.json",
        }


__all__ = ["TASKSET_ID", "V1Stack", "agent_config", "read_episodes", "runtime_config"]
