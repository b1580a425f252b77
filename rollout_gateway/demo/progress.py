"""What the demo shows while it runs and when it ends.

On a terminal: one live progress bar (rich) with done/failed counts, mean reward so far and
elapsed time. Otherwise (a pipe, a CI log): one plain line per finished rollout. At the
end: an aligned per-rollout table whose error column wraps instead of being cut off.

Output whose reader went away (``demo | head``) is not an error: :class:`Screen` stops
writing, and tells the runner once, which stops the run as a ``SIGPIPE`` would (finished
results kept, the run's metadata ending in a final status).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from rollout_gateway.demo.stack import RolloutSummary


class Screen:
    """Lines for the user on ``out``, and a closed reader noticed once (see the module
    docstring). ``on_closed`` is called (once) when a write finds the reader gone."""

    def __init__(self, out: TextIO, on_closed: Callable[[], None] | None = None) -> None:
        self.out = out
        self.on_closed = on_closed
        self.closed = False

    def line(self, text: str = "") -> None:
        """Write one line (dropped once the reader is gone)."""
        self.write(lambda: print(text, file=self.out, flush=True))

    def write(self, action: Callable[[], Any]) -> None:
        """Run ``action`` (which writes to ``out``), noticing a closed reader."""
        if self.closed:
            return
        try:
            action()
        except BrokenPipeError:
            self._reader_gone()
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            self._reader_gone()

    def _reader_gone(self) -> None:
        self.closed = True
        if self.out is sys.stdout:
            # Python flushes stdout at exit: point it at /dev/null so that flush does not
            # fail again ("Exception ignored ... BrokenPipeError").
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
        if self.on_closed is not None:
            self.on_closed()


@dataclass
class Tally:
    """Counts and rewards so far."""

    total: int
    done: int = 0
    failed: int = 0
    rewards: list[float] = field(default_factory=list)

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def add(self, summary: RolloutSummary) -> None:
        self.done += 1
        if summary.failed:
            self.failed += 1
        self.rewards.append(summary.reward)

    def counts(self) -> dict[str, Any]:
        """The counts as ``metadata.json`` records them."""
        return {
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
            "pending": self.total - self.done,
            "mean_reward": self.mean_reward,
        }


class ProgressView:
    """Live progress on a terminal, plain lines elsewhere."""

    def __init__(
        self,
        screen: Screen,
        tally: Tally,
        *,
        terminal: bool | None = None,
    ) -> None:
        """``terminal``: force (or forbid) the live bar; default: whether the output is a TTY."""
        self.screen = screen
        self.console = Console(
            file=screen.out, highlight=False, soft_wrap=False, force_terminal=terminal
        )
        self.live = self.console.is_terminal
        self.tally = tally
        self.started = time.monotonic()
        self._progress: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> ProgressView:
        if self.live:
            self._progress = Progress(
                TextColumn("rollouts"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,  # the bar is cleared when the run ends or is interrupted
            )
            self.screen.write(self._progress.start)
            self._task = self._progress.add_task(
                "rollouts", total=self.tally.total, completed=self.tally.done, status=self._status()
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self.screen.write(self._progress.stop)
            self._progress = None

    def _status(self) -> str:
        mean = self.tally.mean_reward
        shown = f"{mean:.3f}" if mean is not None else "-"
        return f"failed {self.tally.failed}  mean reward {shown}"

    def finished(self, summary: RolloutSummary, verbose: bool) -> None:
        """One rollout finished (already counted in the tally, already on disk)."""
        if self._progress is not None:
            progress = self._progress
            progress.update(self._task, completed=self.tally.done, status=self._status())
            if verbose and summary.error:
                text = f"rollout failed: {summary.error}"
                self.screen.write(lambda: progress.console.print(text))
            return
        error = summary.error or ""
        if not verbose and len(error) > 120:
            error = error[:117] + "..."
        elapsed = time.monotonic() - self.started
        width = len(str(self.tally.total))
        mean = self.tally.mean_reward or 0.0
        self.screen.line(
            f"[{self.tally.done:>{width}}/{self.tally.total}] "
            f"example={summary.example_id} rollout={summary.rollout_index} "
            f"task={summary.task} reward={summary.reward:.2f} turns={summary.turns} "
            f"input_tokens={summary.input_tokens} "
            f"output_tokens={summary.output_tokens} failed={self.tally.failed} "
            f"mean_reward={mean:.3f} elapsed={elapsed:.1f}s" + (f" error={error}" if error else "")
        )


def print_summary(
    screen: Screen, summaries: Iterable[RolloutSummary], lines: list[tuple[str, str]]
) -> None:
    """The per-rollout table, then ``lines`` (label, value) aligned."""
    table = Table(title="rollouts", title_justify="left", show_edge=False, pad_edge=False)
    # tokens in+out: fed to the model (each counted once) + generated, as v1's traces count.
    for name in ("example", "rollout", "task", "reward", "turns", "tokens in+out", "seconds"):
        table.add_column(name, justify="left" if name == "task" else "right", no_wrap=True)
    table.add_column("error", overflow="fold", ratio=1, min_width=20)
    rows = sorted(summaries, key=lambda s: (s.example_id, s.rollout_index))
    for s in rows:
        table.add_row(
            str(s.example_id),
            str(s.rollout_index),
            s.task,
            f"{s.reward:.2f}",
            str(s.turns),
            f"{s.input_tokens}+{s.output_tokens}",
            f"{s.seconds:.1f}",
            s.error or "-",
        )
    width = Console(file=screen.out).width
    console = Console(file=screen.out, highlight=False, width=max(width, 100))

    def show() -> None:
        if rows:
            console.print(table)
        label_width = max(len(label) for label, _ in lines)
        for label, value in lines:
            console.print(f"{label:<{label_width}}  {value}", soft_wrap=True)

    screen.write(show)


__all__ = ["ProgressView", "Screen", "Tally", "print_summary"]
