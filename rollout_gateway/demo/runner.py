"""One demo run, the same on both verifiers stacks; the stack adapter does the rest.

In order:

1. **preflight** (nothing exists yet): the output directory can be created (or, with
   ``--resume``, the run's settings are taken and checked), the local sandboxes can
   contain an agent here, the ``--upstream`` answers with the model. A failure is one
   line and exit code 2, and leaves nothing behind.
2. **the run directory** with ``metadata.json`` (status ``running``), held by this
   process alone.
3. **setup**: the stack is imported off the event loop, the scripted model (or the
   ``--upstream``) and the rollout gateway start on loopback, the stack builds its env.
4. **rollouts**, at most ``--concurrency`` at once, each written to the run directory as
   it finishes, with live progress.
5. **teardown and report**: env, gateway and sandboxes stopped, ``metadata.json`` given
   its final status (``completed``, ``interrupted``, ``timed_out`` or ``failed``), a
   table of every rollout.

SIGINT / SIGTERM (and a closed output pipe) stop the run at any point, within a second
during setup; ``--timeout`` covers all of it. Exit codes: 0 every rollout clean, 1 some
failed (or setup failed), 2 bad input or preflight, 3 ``--timeout``, 128 + the signal
(130 SIGINT, 143 SIGTERM, 141 output closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from rollout_gateway.demo.adapters import check_stack, load_stack
from rollout_gateway.demo.agents import DemoAgent, demo_agent
from rollout_gateway.demo.options import DemoError, DemoOptions
from rollout_gateway.demo.preflight import UNCONTAINED_WARNING, check_upstream
from rollout_gateway.demo.progress import ProgressView, Screen
from rollout_gateway.demo.record import (
    EXIT_FAILED_ROLLOUTS,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    RunRecord,
)
from rollout_gateway.demo.resume import resumed_options
from rollout_gateway.demo.run_dir import check_new, default_output, read_metadata
from rollout_gateway.demo.stack import DemoStack, RolloutSummary, StackSetup, WorkItem
from rollout_gateway.demo.threads import off_loop

#: How each way of stopping early ends: (metadata status, exit code).
_STOPS = {
    "timeout": ("timed_out", EXIT_TIMEOUT),
    "SIGINT": ("interrupted", 128 + signal.SIGINT),
    "SIGTERM": ("interrupted", 128 + signal.SIGTERM),
    "SIGPIPE": ("interrupted", 128 + signal.SIGPIPE),
}
#: Loggers the demo quiets unless ``--verbose`` (their warnings would garble the output).
_LOGGERS = ("verifiers", "rollout_gateway", "httpx", "uvicorn")


def run_demo(
    options: DemoOptions,
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    stack: DemoStack | None = None,
) -> int:
    """Run the demo; returns the process exit code. Progress and the report go to ``out``
    (stdout), errors and warnings to ``err`` (stderr). ``stack``: the adapter to run
    (default: the installed verifiers stack's)."""
    out = out or sys.stdout
    err = err or sys.stderr
    screen = Screen(out)
    run: DemoRun | None = None
    try:
        with _demo_logging(options.verbose):
            name = stack.name if stack is not None else check_stack(options.stack)
            previous = None
            if options.resume is not None:
                previous = read_metadata(options.resume)
                options = resumed_options(options, previous, name)
            run = DemoRun(options, name, screen, err, previous, stack=stack)
            return asyncio.run(run.main())
    except DemoError as e:
        print(f"rollout-gateway demo: error: {e}", file=err, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if run is not None and run.code is not None:
            # After the report (the event loop, and the demo's handlers, gone): the run
            # ended as its report and metadata say.
            return run.code
        # A signal before the demo's own handlers were in place.
        screen.line("demo: interrupted while starting; nothing was created")
        return 128 + signal.SIGINT


@contextlib.contextmanager
def _demo_logging(verbose: bool) -> Iterator[None]:
    """Library logs to stderr with ``--verbose``; otherwise kept off the terminal (the v1
    stack still writes them to the run's ``logs/``). Restored afterwards."""
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in _LOGGERS]
    handler: logging.Handler
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    else:
        handler = logging.NullHandler()
    quiet = [(logger, logger.propagate) for logger, _ in saved]
    for logger, _ in saved:
        logger.setLevel(logging.WARNING if logger.name in ("httpx", "uvicorn") else logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False  # the root's handlers (if any) would print them too
    try:
        yield
    finally:
        for (logger, level), (_, propagate) in zip(saved, quiet, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


class DemoRun:
    """One run: preflight, run directory, setup, rollouts, teardown, report (its results
    are kept by :class:`~.record.RunRecord`)."""

    def __init__(
        self,
        options: DemoOptions,
        stack_name: str,
        screen: Screen,
        err: TextIO,
        previous: dict[str, Any] | None = None,
        *,
        stack: DemoStack | None = None,
    ) -> None:
        self.options = options
        self.stack_name = stack_name
        #: The stack's adapter, imported in preflight (off the event loop) unless given.
        self.stack: DemoStack | None = stack
        self.screen = screen
        self.err = err
        self.path = options.resume or options.output or default_output()
        self.record = RunRecord(options, self.path, screen, previous)
        self.phase = "preflight"
        self.stop_reason: str | None = None
        self.failure: str | None = None
        self.nothing_to_run = False
        #: The real CLI the rollouts run (``--agent``), found in preflight.
        self.agent: DemoAgent | None = None
        self.work: asyncio.Task[None] | None = None
        #: The exit code, once the run has ended (its report printed).
        self.code: int | None = None

    def say(self, text: str) -> None:
        self.screen.line(text)

    # ---------------------------------------------------------------- the run

    async def main(self) -> int:
        """The whole run; returns the exit code."""
        loop = asyncio.get_running_loop()
        self.screen.on_closed = lambda: self._stop("SIGPIPE")
        self._claim_signals()
        timer = loop.call_later(self.options.timeout, self._stop, "timeout")
        self.work = asyncio.create_task(self._phases())
        try:
            await self.work
        except asyncio.CancelledError:
            if self.stop_reason is None:
                raise  # cancelled from outside: not ours to swallow
        except DemoError as e:
            if self.record.run_dir is None:
                raise  # preflight: nothing was created, one line and exit 2
            self.failure = str(e)
            print(f"rollout-gateway demo: error: {e}", file=self.err, flush=True)
        except Exception as e:
            if self.record.run_dir is None:
                raise
            self.failure = f"{type(e).__name__}: {e}"
            print(f"demo: {self.phase} failed: {self.failure}", file=self.err, flush=True)
            if self.options.verbose:
                import traceback

                traceback.print_exc(file=self.err)
        finally:
            timer.cancel()
        return self._finish()

    async def _phases(self) -> None:
        opts, record = self.options, self.record
        # -- preflight: nothing is created or changed before it passes. The checks that
        # need no stack come first (a dead --upstream is refused at once).
        if opts.resume is None:
            check_new(self.path)
            if opts.upstream:
                await check_upstream(opts.upstream, str(opts.model))
        if self.stack is None:
            self.stack = await off_loop(load_stack, self.stack_name)
        stack = self.stack
        if opts.resume is not None:
            stored = record.kept(await off_loop(stack.stored, opts.resume))
            if len(stored) >= record.total:
                self.nothing_to_run = True
                record.summaries = stored
                return
            if opts.upstream:
                await check_upstream(opts.upstream, str(opts.model))
        self.agent = demo_agent(opts.agent)  # a missing CLI: one line, how to install it
        isolation = await off_loop(stack.resolve_isolation, opts.isolation)
        if isolation == "process-group":
            print(UNCONTAINED_WARNING, file=self.err, flush=True)

        # -- the run directory.
        record.open(stack, isolation)
        self.say(f"results         {self.path}/")
        self.say(f"stack           {stack.name} (verifiers {stack.verifiers_version})")
        self.say(f"local sandboxes isolation={isolation}")
        if self.agent is not None:
            self.say(f"agent           {self.agent.describe()}")

        # -- setup.
        self.phase = "setup"
        async with contextlib.AsyncExitStack() as resources:
            await stack.prepare()
            setup = await self._servers(resources, isolation)
            items = await stack.start(setup, resources)
            self._claim_signals()  # building an env may install its own handlers
            record.count_stored()
            of = f" of {record.total}" if len(items) != record.total else ""
            if opts.resume is not None:
                record.metadata["resumes"][-1]["to_run"] = len(items)
                self.say(f"resuming: {record.tally.done} finished, {len(items)} to run")
            self.say(
                f"running {len(items)}{of} rollouts ({opts.examples} tasks x "
                f"{opts.rollouts_per_example}), {opts.concurrency} at once"
            )
            self.phase = "rollouts"
            record.write()
            with ProgressView(self.screen, record.tally) as view:
                await self._rollouts(items, view)
            self.phase = "teardown"

    async def _servers(self, stack: contextlib.AsyncExitStack, isolation: str) -> StackSetup:
        """The model (scripted, or the ``--upstream``) and the gateway, on loopback."""
        from rollout_gateway.scripted import create_scripted_model_app
        from rollout_gateway.server import GatewayConfig, create_app

        opts = self.options
        if opts.upstream:
            upstream, model = opts.upstream.rstrip("/"), str(opts.model)
        else:
            model_root = await _serve(stack, create_scripted_model_app(), "scripted model")
            upstream, model = f"{model_root}/v1", "scripted"
            self.say(f"scripted model  {upstream}")
        admin_token = secrets.token_urlsafe(32)  # the gateway's control plane is protected
        gateway = create_app(GatewayConfig(upstreams=[upstream], admin_token=admin_token))
        gateway_root = await _serve(stack, gateway, "rollout gateway")
        self._claim_signals()  # uvicorn captures SIGINT/SIGTERM while it serves
        self.say(f"rollout gateway {gateway_root}  (upstream {upstream})")
        return StackSetup(
            options=opts,
            run_dir=self.path,
            gateway_url=gateway_root,
            admin_token=admin_token,
            model=model,
            isolation=isolation,
            resuming=opts.resume is not None,
            keep_failed=opts.keep_failed,
            agent=self.agent,
        )

    async def _rollouts(self, items: list[WorkItem], view: ProgressView) -> None:
        limit = asyncio.Semaphore(self.options.concurrency)
        stack = self.stack
        assert stack is not None

        async def one(item: WorkItem) -> None:
            try:
                summary = await stack.run(item, limit)
            except Exception as e:  # not written down: --resume runs it again
                summary = RolloutSummary(
                    example_id=item.example_id,
                    rollout_index=item.rollout_index,
                    task="?",
                    reward=0.0,
                    turns=0,
                    error=f"{type(e).__name__}: {e}",
                )
            self.record.add(summary)
            view.finished(summary, self.options.verbose)

        tasks = [asyncio.create_task(one(item)) for item in items]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            # Let every cancelled rollout run its cleanup (gateway cancel, sandbox delete).
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # ---------------------------------------------------------------- stopping

    def _claim_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._stop, sig.name)

    def _stop(self, reason: str) -> None:
        if self.stop_reason is not None:
            return  # already stopping; cleanup continues
        if self.phase == "teardown":
            # Every rollout has ended: the run is what it is; its teardown (stopping the
            # servers) is quick and is not cut short.
            self.say(f"demo: {reason} received while finishing; every rollout had ended")
            return
        self.stop_reason = reason
        if self.phase in ("setup", "rollouts"):
            what = "removing sandboxes" if self.phase == "rollouts" else "setup abandoned"
            self.say(f"demo: stopping ({self._reason_text()}); {what}...")
        if self.work is not None and not self.work.done():
            self.work.cancel()

    def _reason_text(self) -> str:
        if self.stop_reason == "timeout":
            return f"--timeout {self.options.timeout:g} s reached"
        if self.stop_reason == "SIGPIPE":
            return "output closed"
        return f"{self.stop_reason} received"

    # ---------------------------------------------------------------- the end

    def _finish(self) -> int:
        self.code = self._report()
        return self.code

    def _report(self) -> int:
        if self.nothing_to_run:
            return self.record.report_nothing_to_run()
        if self.record.run_dir is None:  # stopped during preflight
            self.say(f"demo: stopped ({self._reason_text()}) before anything was created")
            return _STOPS[self.stop_reason or "SIGINT"][1]
        status, code = self._outcome()
        self.phase = "teardown"
        stopped = self._reason_text() if self.stop_reason else None
        self.record.finish(status, stopped, self.stop_reason, self.failure)
        return code

    def _outcome(self) -> tuple[str, int]:
        if self.stop_reason is not None:
            return _STOPS[self.stop_reason]
        if self.failure is not None:
            return "failed", EXIT_USAGE if self.phase == "preflight" else EXIT_FAILED_ROLLOUTS
        tally = self.record.tally
        status = "completed" if tally.done >= tally.total else "interrupted"
        return status, EXIT_FAILED_ROLLOUTS if tally.failed else EXIT_OK


async def _serve(stack: contextlib.AsyncExitStack, app: Any, what: str) -> str:
    """Serve ``app`` on loopback until ``stack`` closes."""
    from rollout_gateway.server import running_server

    try:
        return await stack.enter_async_context(running_server(app))
    except Exception as e:
        raise RuntimeError(f"could not start the {what}: {e}") from e


__all__ = [
    "EXIT_FAILED_ROLLOUTS",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "DemoRun",
    "run_demo",
]
