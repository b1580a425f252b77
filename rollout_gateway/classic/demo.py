"""The demo on verifiers 0.3 (``rollout-gateway[classic]``): :class:`ClassicStack`.

Runs :mod:`rollout_gateway.examples.fix_bug_env` (``vf.CliAgentEnv`` +
``RolloutGatewayMixin``) in gateway mode on contained local sandboxes. The run directory
is what vf-eval 0.3 writes: ``results.jsonl`` (one rollout per line in verifiers' output
format, appended and flushed as each finishes) and ``metadata.json`` whose keys are
vf-eval's (built by verifiers' own ``GenerateOutputsBuilder``: ``avg_reward``,
``num_examples``, ``rollouts_per_example``, ``sampling_args``, ``base_url``,
``version_info``, ...) plus the demo's. Each line also carries ``rollout_index``,
``duration_s`` and ``sandbox_isolation``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
from pathlib import Path
from typing import IO, Any

from rollout_gateway.demo.stack import (
    DemoStack,
    RolloutSummary,
    StackSetup,
    WorkItem,
    new_input_tokens,
)
from rollout_gateway.demo.threads import off_loop

RESULTS_FILE = "results.jsonl"
#: What the classic stack imports (seconds, off the event loop: see :meth:`prepare`).
_MODULES = (
    "openai",
    "verifiers",
    "verifiers.legacy.utils.save_utils",
    "rollout_gateway.examples.fix_bug_env.env",
)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The rollouts of ``results.jsonl``; a torn last line (a killed writer) is ignored."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and _key(record) is not None:
            records.append(record)
    return records


def _key(record: dict[str, Any]) -> tuple[int, int] | None:
    try:
        return int(record["example_id"]), int(record["rollout_index"])
    except (KeyError, TypeError, ValueError):
        return None


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """Store each token list once: a step's ``response.message.tokens`` repeats
    ``step.tokens`` (the ids the trainer uses), so it is dropped when identical."""
    for step in record.get("trajectory") or []:
        response = step.get("response")
        message = response.get("message") if isinstance(response, dict) else None
        if isinstance(message, dict) and "tokens" in message:
            tokens = message["tokens"]
            step_tokens = step.get("tokens") or {}
            if tokens is None or all(step_tokens.get(k) == v for k, v in tokens.items()):
                del message["tokens"]
    return record


def error_text(record: dict[str, Any]) -> str | None:
    """``Type: message`` of a record's error, or None."""
    error = record.get("error")
    if not error:
        return None
    if isinstance(error, dict):
        return f"{error.get('error', 'Error')}: {error.get('message', '')}".strip()
    return str(error)


def summarize(record: dict[str, Any]) -> RolloutSummary:
    """The demo's view of one stored rollout."""
    steps = [s["tokens"] for s in record.get("trajectory") or [] if s.get("tokens")]
    info = record.get("info")
    if not isinstance(info, dict):
        info = {}
    return RolloutSummary(
        example_id=int(record["example_id"]),
        rollout_index=int(record["rollout_index"]),
        task=str(info.get("task_id") or "?"),
        reward=float(record.get("reward") or 0.0),
        turns=len(record.get("trajectory") or []),
        input_tokens=new_input_tokens(
            (len(t.get("prompt_ids") or []), len(t.get("completion_ids") or [])) for t in steps
        ),
        output_tokens=sum(len(t.get("completion_ids") or []) for t in steps),
        seconds=float(record.get("duration_s") or 0.0),
        error=error_text(record),
    )


class ClassicStack(DemoStack):
    """The demo's verifiers 0.3 part (see the module docstring)."""

    name = "classic"
    env_id = "rollout_gateway.examples.fix_bug_env"

    def __init__(self) -> None:
        self._env: Any = None
        self._client: Any = None
        self._setup: StackSetup | None = None
        self._builder: Any = None
        self._file: IO[str] | None = None

    def stored(self, run_dir: Path) -> list[RolloutSummary]:
        seen: set[tuple[int, int]] = set()
        summaries = []
        for record in read_records(run_dir / RESULTS_FILE):
            key = _key(record)
            if key is not None and key not in seen:
                seen.add(key)
                summaries.append(summarize(record))
        return summaries

    async def prepare(self) -> None:
        for module in _MODULES:
            await off_loop(importlib.import_module, module)

    async def start(self, setup: StackSetup, stack: contextlib.AsyncExitStack) -> list[WorkItem]:
        import verifiers as vf
        from openai import AsyncOpenAI
        from verifiers.legacy.utils.save_utils import GenerateOutputsBuilder
        from verifiers.types import ClientConfig

        from rollout_gateway.examples import fix_bug_env
        from rollout_gateway.local_sandbox import LocalSandboxClient

        opts = setup.options
        self._setup = setup
        agent = setup.agent
        # A real CLI (--agent): its install seen read-only by every sandbox, run in the
        # example agent's place on the same task (task.md), with nothing to set up.
        sandboxes = LocalSandboxClient(
            isolation=setup.isolation, read_only=agent.read_only if agent else ()
        )
        cli_agent: dict[str, Any] = {}
        if agent is not None:
            from rollout_gateway.examples.fix_bug_env.env import DEFAULT_TASK_DIR as task_dir

            cli_agent = {
                "run_command": f"cd {task_dir} && {agent.command()}",
                "agent_setup_command": None,
            }
        stack.callback(sandboxes.teardown)  # idempotent: the env's teardown does it first
        env_args = {"num_examples": opts.examples, "use_gateway": True, "sandbox_backend": "local"}
        self._env = fix_bug_env.load_environment(
            **env_args,
            sandbox_client=sandboxes,
            gateway={"tunnel_provider": "direct", "admin_token": setup.admin_token},
            timeout_seconds=min(opts.timeout, 600.0),
            **cli_agent,
        )
        stack.push_async_callback(self._env._teardown)
        self._client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=f"{setup.gateway_url}/v1", api_key="demo")
        )
        kept = self._keep(setup)
        self._builder = GenerateOutputsBuilder(
            env_id=self.env_id,
            env_args=env_args,
            model=setup.model,
            client=ClientConfig(api_base_url=f"{setup.gateway_url}/v1"),  # as vf-eval's -b
            num_examples=opts.examples,
            rollouts_per_example=opts.rollouts_per_example,
            state_columns=["trajectory"],
            sampling_args=self._sampling(),
            results_path=setup.run_dir,
        )
        self._builder.add_outputs(kept)
        self._file = (setup.run_dir / RESULTS_FILE).open("a", encoding="utf-8")
        stack.callback(self._close)
        done = {_key(r) for r in kept}
        return [
            WorkItem(example_id, index, row)
            for example_id, row in enumerate(self._env.get_dataset(n=opts.examples))
            for index in range(opts.rollouts_per_example)
            if (example_id, index) not in done
        ]

    def _keep(self, setup: StackSetup) -> list[dict[str, Any]]:
        """On resume, rewrite ``results.jsonl`` to the rollouts kept (each once), atomically."""
        path = setup.run_dir / RESULTS_FILE
        if not setup.resuming:
            path.touch()
            return []
        kept: dict[tuple[int, int], dict[str, Any]] = {}
        for record in read_records(path):
            key = _key(record)
            if key is None or key in kept:
                continue
            if setup.keep_failed or record.get("error") is None:
                kept[key] = record
        tmp = path.with_name(f".{RESULTS_FILE}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept.values()), encoding="utf-8")
        os.replace(tmp, path)
        return list(kept.values())

    def _sampling(self) -> dict[str, Any]:
        assert self._setup is not None
        opts = self._setup.options
        return {"temperature": opts.temperature, "max_tokens": opts.max_tokens}

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    async def run(self, item: WorkItem, limit: asyncio.Semaphore) -> RolloutSummary:
        from verifiers.legacy.utils.save_utils import make_serializable

        assert self._setup is not None and self._file is not None
        row = item.handle
        async with limit:
            started = asyncio.get_running_loop().time()
            data: dict[str, Any] = {k: row[k] for k in ("prompt", "answer", "info") if k in row}
            data["example_id"] = item.example_id
            output = await self._env.run_rollout(
                data,
                self._client,
                self._setup.model,
                self._sampling(),
                state_columns=["trajectory"],
            )
        record = dict(output)
        record["example_id"] = item.example_id
        record["rollout_index"] = item.rollout_index
        record["duration_s"] = round(asyncio.get_running_loop().time() - started, 3)
        record["sandbox_isolation"] = self._setup.isolation
        stored = compact(json.loads(json.dumps(record, default=make_serializable)))
        self._file.write(json.dumps(stored) + "\n")
        self._file.flush()  # on disk (the OS's) before anything else can go wrong
        self._builder.add_outputs([stored])
        return summarize(stored)

    def metadata(self) -> dict[str, Any]:
        """vf-eval 0.3's ``metadata.json`` keys for this run (what ``save_metadata`` writes)."""
        if self._builder is None:
            return {}
        from verifiers.legacy.utils.save_utils import make_serializable

        built = dict(self._builder.build_metadata())
        built.pop("path_to_save", None)
        built.pop("date", None)
        return dict(json.loads(json.dumps(built, default=make_serializable)))


__all__ = ["RESULTS_FILE", "ClassicStack", "compact", "read_records", "summarize"]
