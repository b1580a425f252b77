"""``rollout-gateway demo``: the whole system on one machine, run like an evaluation tool.

Starts the scripted model (or checks ``--upstream``) and the reference gateway on
loopback, runs the example env (:mod:`rollout_gateway.examples.fix_bug_env`) in gateway
mode on contained local sandboxes, writes each rollout to ``results.jsonl`` as it
finishes, keeps ``metadata.json`` current, shows progress, and on Ctrl-C / SIGTERM /
``--timeout`` stops cleanly: in-flight rollouts cancelled, finished ones kept, sandboxes
removed, one status line, no traceback. ``--resume DIR`` continues such a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rollout_gateway.demo.options import (
    DEFAULT_OUTPUT_ROOT,
    ENV_ID,
    RESUMED_FIELDS,
    DemoError,
    DemoOptions,
)
from rollout_gateway.demo.progress import ProgressView, Tally
from rollout_gateway.demo.results import ResultsDir, now_iso, rollout_key, versions

#: Exit codes: all rollouts clean, some failed, bad input, timed out, signals (128 + n).
EXIT_OK, EXIT_FAILED_ROLLOUTS, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
_QUIET_LOGGERS = ("verifiers", "rollout_gateway", "httpx", "uvicorn")


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Run the demo; returns the process exit code. Output goes to ``out`` (stdout)."""
    out = out or sys.stdout
    _configure_logging(options.verbose)
    try:
        if _verifiers_is_v1():  # rollout-gateway[v1]: the v1 example through the gateway
            from rollout_gateway.v1.demo import run_v1_demo

            return asyncio.run(run_v1_demo(options, out))
        return asyncio.run(_Demo(options, out).run())
    except DemoError as e:
        print(f"demo: {e}", file=out, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:  # a signal before the demo's own handlers were in place
        print("demo: interrupted while starting; nothing was run", file=out, flush=True)
        return 128 + signal.SIGINT


def _verifiers_is_v1() -> bool:
    """Whether the installed verifiers is 0.4+ (``verifiers.v1`` only, no ``CliAgentEnv``)."""
    from importlib import metadata

    try:
        major, minor = (int(p) for p in metadata.version("verifiers").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (0, 4)


def _configure_logging(verbose: bool) -> None:
    if verbose:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )
        for name in ("verifiers", "rollout_gateway"):
            logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    else:
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


class _Demo:
    """One run: preflight, servers, env, rollouts, teardown, report."""

    def __init__(self, options: DemoOptions, out: TextIO) -> None:
        self.options = options
        self.out = out
        self.stop_reason: str | None = None
        self.work: asyncio.Task[None] | None = None
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.started_at = now_iso()
        self.metadata: dict[str, Any] = {}

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # ---------------------------------------------------------------- preflight

    def _open_results(self) -> tuple[ResultsDir, list[dict[str, Any]]]:
        opts = self.options
        if opts.resume is not None:
            results, meta, records = ResultsDir.open_existing(opts.resume)
            previous = meta.get("options") or {}
            self.options = dataclasses.replace(
                opts, **{k: previous[k] for k in RESUMED_FIELDS if k in previous}
            )
            return results, records
        path = opts.output or DEFAULT_OUTPUT_ROOT / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        return ResultsDir.create(path), []

    def _sandbox_client(self) -> Any:
        from rollout_gateway.local_sandbox import IsolationUnavailableError, LocalSandboxClient

        try:
            client = LocalSandboxClient(isolation=self.options.isolation)
        except IsolationUnavailableError as e:
            raise DemoError(str(e)) from None
        except OSError as e:
            raise DemoError(f"cannot prepare local sandboxes: {e}") from None
        if not client.isolation.has_mount_namespace_view and not _reachable_by_others(
            sys.executable
        ):
            client.teardown()
            raise DemoError(
                f"isolation {client.isolation} runs the agent as an unprivileged uid, which "
                f"cannot run this Python ({os.path.realpath(sys.executable)}: a parent "
                "directory is not searchable by others); install bubblewrap "
                "(apt-get install bubblewrap) or use a Python installed outside such a directory"
            )
        return client

    # ---------------------------------------------------------------- run

    async def run(self) -> int:
        from rollout_gateway.demo.preflight import check_upstream

        results, previous = self._open_results()
        opts = self.options
        if opts.upstream:
            await check_upstream(opts.upstream, str(opts.model))
        sandboxes = self._sandbox_client()  # fails here, before anything runs, if uncontained
        done_keys = {k for k in (rollout_key(r) for r in previous) if k is not None}
        total = opts.examples * opts.rollouts_per_example
        tally = Tally(total=total)
        for record in previous:
            if rollout_key(record) is not None:
                tally.add(record)
        self.metadata = {
            "env_id": ENV_ID,
            "model": opts.model or "scripted",
            "upstream": opts.upstream or "scripted model (built in)",
            "options": opts.recorded(),
            "versions": versions(),
            "isolation": str(sandboxes.isolation),
            "started_at": self.started_at,
            "status": "running",
            "results": str(results.results.name),
        }
        if opts.resume is not None:
            self.metadata["resumed_at"] = self.started_at
        results.write_metadata({**self.metadata, "counts": self._counts(tally)})
        self.say(f"results         {results.path}/")
        self.say(f"local sandboxes isolation={sandboxes.isolation}")
        try:
            await self._serve_and_run(results, sandboxes, tally, done_keys)
        finally:
            sandboxes.teardown()  # idempotent: the env's teardown already did it
            results.close()
        return self._finish(results, previous, tally)

    async def _serve_and_run(
        self, results: ResultsDir, sandboxes: Any, tally: Tally, done_keys: set[tuple[int, int]]
    ) -> None:
        import verifiers as vf
        from openai import AsyncOpenAI

        from rollout_gateway.examples import fix_bug_env
        from rollout_gateway.scripted import create_scripted_model_app
        from rollout_gateway.server import GatewayConfig, create_app

        opts = self.options
        # Closed in reverse: the env's teardown, then the gateway, then the scripted model.
        async with contextlib.AsyncExitStack() as stack:
            if opts.upstream:
                upstream, model = opts.upstream.rstrip("/"), str(opts.model)
            else:
                model_root = await _serve(stack, create_scripted_model_app(), "scripted model")
                upstream, model = f"{model_root}/v1", opts.model or "scripted"
                self.say(f"scripted model  {upstream}")
            admin_token = secrets.token_urlsafe(32)  # the gateway's control plane is protected
            gateway_app = create_app(GatewayConfig(upstreams=[upstream], admin_token=admin_token))
            gateway_root = await _serve(stack, gateway_app, "gateway")
            self.say(f"rollout gateway {gateway_root}  (upstream {upstream})")
            env = fix_bug_env.load_environment(
                num_examples=opts.examples,
                use_gateway=True,
                sandbox_backend="local",
                sandbox_client=sandboxes,
                gateway={"tunnel_provider": "direct", "admin_token": admin_token},
                timeout_seconds=min(opts.timeout, 600.0),
            )
            stack.push_async_callback(env._teardown)
            # Last: uvicorn and verifiers' Environment both install SIGINT/SIGTERM handlers.
            self._install_signal_handlers()
            client = vf.OpenAIChatCompletionsClient(
                AsyncOpenAI(base_url=f"{gateway_root}/v1", api_key="demo")
            )
            rows = [
                (example_id, index, row)
                for example_id, row in enumerate(env.get_dataset(n=opts.examples))
                for index in range(opts.rollouts_per_example)
                if (example_id, index) not in done_keys
            ]
            if done_keys:
                self.say(f"resuming: {len(done_keys)} finished, {len(rows)} to run")
            self.say(
                f"running {len(rows)} rollouts ({opts.examples} tasks x "
                f"{opts.rollouts_per_example}), {opts.concurrency} at once"
            )
            with ProgressView(self.out, tally.total, tally) as view:
                self.work = asyncio.create_task(
                    self._rollouts(env, client, model, rows, results, view)
                )
                timer = asyncio.get_running_loop().call_later(opts.timeout, self._stop, "timeout")
                try:
                    await self.work
                except asyncio.CancelledError:
                    if self.stop_reason is None:
                        raise  # cancelled from outside: not ours to swallow
                finally:
                    timer.cancel()
            if self.stop_reason is not None:
                self.say(f"demo: stopping ({self._reason_text()}); removing sandboxes...")

    async def _rollouts(
        self,
        env: Any,
        client: Any,
        model: str,
        rows: list[tuple[int, int, dict[str, Any]]],
        results: ResultsDir,
        view: ProgressView,
    ) -> None:
        opts = self.options
        limit = asyncio.Semaphore(opts.concurrency)
        sampling = {"temperature": opts.temperature, "max_tokens": opts.max_tokens}

        async def one(example_id: int, index: int, row: dict[str, Any]) -> None:
            async with limit:
                started = time.monotonic()
                data: dict[str, Any] = {k: row[k] for k in ("prompt", "answer", "info") if k in row}
                data["example_id"] = example_id
                output = await env.run_rollout(
                    data, client, model, sampling, state_columns=["trajectory"]
                )
            record = dict(output)
            record["example_id"] = example_id
            record["rollout_index"] = index
            record["duration_s"] = round(time.monotonic() - started, 3)
            record["sandbox_isolation"] = self.metadata["isolation"]
            stored = results.append(record)  # on disk before anything else can go wrong
            self.records.append(stored)
            view.finished(stored, opts.verbose)

        tasks = [asyncio.create_task(one(*row)) for row in rows]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            # Let every cancelled rollout run its cleanup (gateway cancel, sandbox delete).
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # ---------------------------------------------------------------- stopping

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop, sig.name)

    def _stop(self, reason: str) -> None:
        if self.stop_reason is not None:
            return  # already stopping; cleanup continues
        self.stop_reason = reason
        if self.work is not None and not self.work.done():
            self.work.cancel()

    def _reason_text(self) -> str:
        if self.stop_reason == "timeout":
            return f"--timeout {self.options.timeout:g} s reached"
        return f"{self.stop_reason} received"

    def _counts(self, tally: Tally) -> dict[str, Any]:
        return {
            "total": tally.total,
            "done": tally.done,
            "failed": tally.failed,
            "pending": tally.total - tally.done,
            "mean_reward": tally.mean_reward,
        }

    def _finish(self, results: ResultsDir, previous: list[dict[str, Any]], tally: Tally) -> int:
        status = {None: "completed", "timeout": "timed_out"}.get(self.stop_reason, "interrupted")
        duration = time.monotonic() - self.started
        self.metadata.update(
            status=status,
            finished_at=now_iso(),
            duration_s=round(duration, 3),
            counts=self._counts(tally),
        )
        results.write_metadata(self.metadata)
        view = ProgressView(self.out, tally.total)
        mean = tally.mean_reward
        lines = [
            ("status", status + (f" ({self._reason_text()})" if self.stop_reason else "")),
            ("rollouts", f"{tally.done}/{tally.total} done, {tally.failed} failed"),
            ("mean reward", f"{mean:.3f}" if mean is not None else "-"),
            ("elapsed", f"{duration:.1f} s"),
            ("isolation", self.metadata["isolation"]),
            ("results", str(results.results)),
            ("metadata", str(results.metadata_path)),
        ]
        if tally.done < tally.total:
            lines.append(("resume with", f"rollout-gateway demo --resume {results.path}"))
        view.summary([*previous, *self.records], lines)
        if self.stop_reason == "timeout":
            return EXIT_TIMEOUT
        if self.stop_reason is not None:
            return 128 + int(getattr(signal, self.stop_reason, signal.SIGINT))
        return EXIT_FAILED_ROLLOUTS if tally.failed else EXIT_OK


def _reachable_by_others(path: str) -> bool:
    """Whether an unprivileged user can reach ``path``'s real location."""
    real = Path(os.path.realpath(path))
    return all(os.stat(parent).st_mode & 0o001 for parent in real.parents)


async def _serve(stack: contextlib.AsyncExitStack, app: Any, what: str) -> str:
    """Serve ``app`` on loopback until ``stack`` closes; a failed start is a DemoError."""
    from rollout_gateway.server import running_server

    try:
        return await stack.enter_async_context(running_server(app))
    except Exception as e:
        raise DemoError(f"could not start the {what}: {e}") from e


__all__ = ["EXIT_FAILED_ROLLOUTS", "EXIT_OK", "EXIT_TIMEOUT", "EXIT_USAGE", "run_demo"]
