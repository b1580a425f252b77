"""What differs between the verifiers stacks the demo runs on: :class:`DemoStack`.

The runner core (:mod:`.runner`) owns everything a user sees the same on both stacks:
options, preflight, the run directory's ``metadata.json``, progress, signals, the time
limit, ``--resume`` and exit codes. A stack adapter owns the rest:

- its example env, built and served for one run (:meth:`DemoStack.start`);
- the files its own tooling reads in the run directory (classic: ``results.jsonl`` and
  vf-eval's ``metadata.json`` keys; v1: ``configs/``, ``traces.jsonl``, ``logs/``);
- one rollout, run and written down (:meth:`DemoStack.run`).

Each adapter lives beside its stack: :class:`rollout_gateway.classic.demo.ClassicStack`
(verifiers 0.3) and :class:`rollout_gateway.v1.demo.V1Stack` (verifiers 0.4). This module
is the interface alone: it imports neither; :mod:`.adapters` resolves a stack's adapter
by name. The help text of each stack's demo is in :mod:`.options` (``demo --help``
imports no stack).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rollout_gateway.demo.agents import DemoAgent
from rollout_gateway.demo.options import DemoOptions


@dataclass(frozen=True)
class RolloutSummary:
    """One finished rollout as the demo shows and counts it (stack-neutral)."""

    example_id: int
    rollout_index: int
    task: str
    reward: float
    turns: int
    #: Tokens fed to the model (system, user, tool), each counted once: every turn's
    #: prompt beyond the previous turn's prompt and completion (:func:`new_input_tokens`,
    #: what verifiers v1's trace calls ``num_input_tokens``).
    input_tokens: int = 0
    #: Tokens the model generated, all turns together (``num_output_tokens``).
    output_tokens: int = 0
    seconds: float = 0.0
    #: ``Type: message`` of what went wrong, or None.
    error: str | None = None

    @property
    def failed(self) -> bool:
        """The rollout did not run to a scored end (what ``--resume`` runs again)."""
        return self.error is not None


def new_input_tokens(turns: Iterable[tuple[int, int]]) -> int:
    """Tokens fed in over ``turns`` (each turn's prompt and completion lengths), each
    counted once: a turn's prompt beyond the previous turn's prompt plus completion,
    never below zero (exact while the history only grows), as verifiers v1 counts them."""
    total = previous = 0
    for prompt, completion in turns:
        total += max(0, prompt - previous)
        previous = prompt + completion
    return total


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
    #: The real CLI each sandbox runs instead of the example agent (``--agent``).
    agent: DemoAgent | None = None


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


__all__ = ["DemoStack", "RolloutSummary", "StackSetup", "WorkItem", "new_input_tokens"]
