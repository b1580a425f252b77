"""What the demo shows while it runs and when it ends.

On a terminal: one live progress bar (rich) with done/failed counts, mean reward so far and
elapsed time. Otherwise (a pipe, a CI log): one plain line per finished rollout. At the
end: an aligned per-rollout table whose error column wraps instead of being cut off.
"""

from __future__ import annotations

import time
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

    def add(self, record: dict[str, Any]) -> None:
        self.done += 1
        if record.get("error"):
            self.failed += 1
        self.rewards.append(float(record.get("reward") or 0.0))


def error_text(record: dict[str, Any]) -> str:
    """``Type: message`` of a record's error, or empty."""
    error = record.get("error")
    if not error:
        return ""
    if isinstance(error, dict):
        return f"{error.get('error', 'Error')}: {error.get('message', '')}".strip()
    return str(error)


def token_counts(record: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens of the last turn, completion tokens over all turns)."""
    steps = [s["tokens"] for s in record.get("trajectory") or [] if s.get("tokens")]
    prompt = len(steps[-1].get("prompt_ids") or []) if steps else 0
    return prompt, sum(len(t.get("completion_ids") or []) for t in steps)


class ProgressView:
    """Live progress on a terminal, plain lines elsewhere."""

    def __init__(
        self,
        out: TextIO,
        total: int,
        already: Tally | None = None,
        *,
        terminal: bool | None = None,
    ) -> None:
        """``terminal``: force (or forbid) the live bar; default: whether ``out`` is a TTY."""
        self.out = out
        self.console = Console(file=out, highlight=False, soft_wrap=False, force_terminal=terminal)
        self.live = self.console.is_terminal
        self.tally = already or Tally(total=total)
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
            self._progress.start()
            self._task = self._progress.add_task(
                "rollouts", total=self.tally.total, completed=self.tally.done, status=self._status()
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _status(self) -> str:
        mean = self.tally.mean_reward
        shown = f"{mean:.3f}" if mean is not None else "-"
        return f"failed {self.tally.failed}  mean reward {shown}"

    def finished(self, record: dict[str, Any], verbose: bool) -> None:
        """One rollout finished (its record is already on disk)."""
        self.tally.add(record)
        if self._progress is not None:
            self._progress.update(self._task, completed=self.tally.done, status=self._status())
            if verbose and record.get("error"):
                self._progress.console.print(f"rollout failed: {error_text(record)}")
            return
        prompt, completion = token_counts(record)
        error = error_text(record)
        if not verbose and len(error) > 120:
            error = error[:117] + "..."
        elapsed = time.monotonic() - self.started
        width = len(str(self.tally.total))
        print(
            f"[{self.tally.done:>{width}}/{self.tally.total}] "
            f"example={record.get('example_id')} rollout={record.get('rollout_index')} "
            f"reward={float(record.get('reward') or 0.0):.2f} "
            f"turns={len(record.get('trajectory') or [])} prompt_tokens={prompt} "
            f"completion_tokens={completion} failed={self.tally.failed} "
            f"mean_reward={self.tally.mean_reward:.3f} elapsed={elapsed:.1f}s"
            + (f" error={error}" if error else ""),
            file=self.out,
            flush=True,
        )

    def summary(self, records: list[dict[str, Any]], lines: list[tuple[str, str]]) -> None:
        """The per-rollout table, then ``lines`` (label, value) aligned."""
        table = Table(title="rollouts", title_justify="left", show_edge=False, pad_edge=False)
        for name in ("example", "rollout", "reward", "turns", "tokens", "seconds"):
            table.add_column(name, justify="right", no_wrap=True)
        table.add_column("error", overflow="fold", ratio=1, min_width=20)
        for record in sorted(records, key=lambda r: (r.get("example_id"), r.get("rollout_index"))):
            prompt, completion = token_counts(record)
            table.add_row(
                str(record.get("example_id")),
                str(record.get("rollout_index")),
                f"{float(record.get('reward') or 0.0):.2f}",
                str(len(record.get("trajectory") or [])),
                f"{prompt}+{completion}",
                f"{float(record.get('duration_s') or 0.0):.1f}",
                error_text(record) or "-",
            )
        console = Console(file=self.out, highlight=False, width=max(self.console.width, 100))
        if records:
            console.print(table)
        width = max(len(label) for label, _ in lines)
        for label, value in lines:
            console.print(f"{label:<{width}}  {value}", soft_wrap=True)


__all__ = ["ProgressView", "Tally", "error_text", "token_counts"]
