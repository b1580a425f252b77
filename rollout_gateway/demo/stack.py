"""What differs between the verifiers stacks the demo runs on: :class:`DemoStack`.

The runner core (:mod:`.runner`) owns everything a user sees the same on both stacks:
options, preflight, the run directory's ``metadata.json``, progress, signals, the time
limit, ``--resume`` and exit codes. A stack adapter owns the rest:

- its example env, built and served for one run (:meth:`DemoStack.start`);
- the files its own tooling reads in the run directory (classic: ``results.jsonl`` and
  vf-eval's ``metadata.json`` keys; v1: ``configs/``, ``traces.jsonl``, ``logs/``);
- one rollout, run and written down (:meth:`DemoStack.run`).

Adapters: :class:`rollout_gateway.demo.classic.ClassicStack` (verifiers 0.3) and
:class:`rollout_gateway.v1.demo.V1Stack` (verifiers 0.4). Which one runs is decided by
the installed verifiers (:func:`rollout_gateway.verifiers_stack.installed_stack`);
``--stack`` names it explicitly.
The help text of each stack's demo is in :mod:`.options` (``demo --help`` imports no
stack).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from rollout_gateway.demo.options import STACKS, DemoError, DemoOptions
from rollout_gateway.verifiers_stack import installed_stack, verifiers_version

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutSummary:
    """One finished rollout as the demo shows and counts it (stack-neutral)."""

    example_id: int
    rollout_index: int
    task: str
    reward: float
    turns: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    #: ``Type: message`` of what went wrong, or None.
    error: str | None = None

    @property
    def failed(self) -> bool:
        """The rollout did not run to a scored end (what ``--resume`` runs again)."""
        return self.error is not None


@dataclass(frozen=True)
class StackSetup:
    """What the core hands a stack when the run's servers are up."""

    options: DemoOptions
    run_dir: Path
    #: The rollout gateway's root URL (``http://host:port``) and its control-plane token.
    gateway_url: str
    admin_token: str
    #: The model the gateway's upstream serves.
    model: str
    #: The local sandbox isolation mode the rollouts run under (resolved by preflight).
    isolation: str
    #: Continuing an existing run: its stored rollouts are planned against, not replaced.
    resuming: bool = False
    #: Rollouts to keep from the stored ones (their failures are not run again).
    keep_failed: bool = False


@dataclass
class WorkItem:
    """One rollout to run: where it goes in the table, and the stack's own handle."""

    example_id: int
    rollout_index: int
    handle: Any = field(default=None, repr=False)


class DemoStack(ABC):
    """A verifiers stack's part of the demo (see the module docstring)."""

    #: ``classic`` or ``v1``.
    name: ClassVar[str]
    #: The env the demo runs, by the id the stack's own tools take (vf-eval).
    env_id: ClassVar[str]
    #: The installed verifiers version (recorded in ``metadata.json``).
    verifiers_version: str = ""

    # -- before anything runs (no stack imports: called before the run directory exists)

    @abstractmethod
    def stored(self, run_dir: Path) -> list[RolloutSummary]:
        """The rollouts an existing run directory holds (for ``--resume``)."""

    def resolve_isolation(self, requested: str) -> str:
        """The isolation mode rollouts will run under (``DemoError`` if unavailable).

        Called off the event loop: probing may start processes."""
        from rollout_gateway.demo.preflight import probe_isolation

        return probe_isolation(requested)

    # -- the run

    @abstractmethod
    async def prepare(self) -> None:
        """Import the stack (seconds): called in setup, interruptible (use :func:`off_loop`)."""

    @abstractmethod
    async def start(self, setup: StackSetup, stack: contextlib.AsyncExitStack) -> list[WorkItem]:
        """Build and serve the env for this run (its teardown pushed on ``stack``), write
        the stack's own files into the run directory, and return the rollouts to run:
        all of them, or on resume those the stored ones do not cover (stored rollouts
        that are not kept are dropped from the stack's files here, not before)."""

    @abstractmethod
    async def run(self, item: WorkItem, limit: asyncio.Semaphore) -> RolloutSummary:
        """Run one rollout (at most ``limit`` at once), write it to the run directory
        before returning, and summarize it."""

    def metadata(self) -> dict[str, Any]:
        """The stack's own keys of ``metadata.json`` (merged under the demo's)."""
        return {}


_EXTRA = {"classic": "rollout-gateway[classic]", "v1": "rollout-gateway[v1]"}


def check_stack(requested: str = "auto") -> str:
    """The installed stack's name; ``DemoError`` when ``requested`` names the other one
    or no verifiers is installed (reads package metadata only: imports nothing)."""
    installed = installed_stack()
    if installed is None:
        raise DemoError(
            "no verifiers stack is installed: pip install 'rollout-gateway[v1]' (verifiers "
            "0.4) or 'rollout-gateway[classic]' (verifiers 0.3), in separate virtualenvs"
        )
    if requested not in ("auto", installed):
        other = {"classic": "verifiers 0.3", "v1": "verifiers 0.4"}[requested]
        raise DemoError(
            f"--stack {requested} needs {other} ({_EXTRA[requested]}); this environment has "
            f"verifiers {verifiers_version()}, the {installed} stack (the two extras exclude "
            f"each other: use another virtualenv, or --stack {installed})"
        )
    return installed


def load_stack(name: str) -> DemoStack:
    """A new adapter of stack ``name`` (imports its module: seconds for v1, whose
    package imports verifiers; call it off the event loop)."""
    stack = stack_class(name)()
    stack.verifiers_version = verifiers_version() or ""
    return stack


def stack_class(name: str) -> type[DemoStack]:
    """The adapter class of stack ``name``."""
    if name == "classic":
        from rollout_gateway.demo.classic import ClassicStack

        return ClassicStack
    if name == "v1":
        from rollout_gateway.v1.demo import V1Stack

        return V1Stack
    raise ValueError(f"unknown stack {name!r} (known: {', '.join(STACKS)})")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking ``fn(*args)`` in a daemon thread; the caller can be cancelled at once.

    Used for imports and probes that take seconds, so that a signal stops the demo
    promptly: the event loop stays free to run its handler, and a cancelled caller does
    not wait for the thread (a daemon thread does not hold up the process's exit either,
    unlike ``asyncio.to_thread``'s pool).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return  # the caller gave up (cancelled)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the caller
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
                loop.call_soon_threadsafe(settle, None, e)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, None)

    name = f"{_THREAD_PREFIX}{getattr(fn, '__name__', 'work')}"
    threading.Thread(target=work, name=name, daemon=True).start()
    return await future


_THREAD_PREFIX = "demo-off-loop-"


def off_loop_threads() -> set[threading.Thread]:
    """The threads of :func:`off_loop` work still running."""
    return {t for t in threading.enumerate() if t.name.startswith(_THREAD_PREFIX)}


def exit_if_work_abandoned(code: int, before: set[threading.Thread]) -> None:
    """End the process now, with ``code``, when :func:`off_loop` work started by the run
    (not among ``before``) still runs.

    A stop during setup abandons the stack's import in its daemon thread; the
    interpreter's shutdown would then wait seconds for that import to let go of the GIL.
    Nothing of the run is left to clean up by then (the stack had not started: its
    sandboxes and servers come after the import), so output is flushed, logging shut down
    and the process ends. Only the command line calls this, after the run returned.
    """
    if not off_loop_threads() - before:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


__all__ = [
    "DemoStack",
    "RolloutSummary",
    "StackSetup",
    "WorkItem",
    "check_stack",
    "exit_if_work_abandoned",
    "load_stack",
    "off_loop",
    "off_loop_threads",
    "stack_class",
]
