"""What a demo run writes down: ``metadata.json`` from its first status to its final one,
the rollouts counted so far, and the report printed at the end.

:class:`~.runner.DemoRun` drives the run (phases, signals, the time limit);
:class:`RunRecord` keeps its results.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rollout_gateway.demo.options import DemoOptions
from rollout_gateway.demo.progress import Screen, Tally, print_summary
from rollout_gateway.demo.resume import resume_command, resume_entry
from rollout_gateway.demo.run_dir import RunDir, now_iso, versions
from rollout_gateway.demo.stack import DemoStack, RolloutSummary

EXIT_OK, EXIT_FAILED_ROLLOUTS, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3


class RunRecord:
    """The results of one run (see the module docstring)."""

    def __init__(
        self, options: DemoOptions, path: Path, screen: Screen, previous: dict[str, Any] | None
    ) -> None:
        self.options = options
        self.path = path
        self.screen = screen
        #: The metadata of the run being resumed.
        self.previous = previous or {}
        self.total = options.examples * options.rollouts_per_example
        self.tally = Tally(total=self.total)
        self.summaries: list[RolloutSummary] = []
        self.run_dir: RunDir | None = None
        self.metadata: dict[str, Any] = {}
        self.stack: DemoStack | None = None
        self.started = time.monotonic()
        self.started_at = now_iso()

    def kept(self, stored: list[RolloutSummary]) -> list[RolloutSummary]:
        """The stored rollouts a resumed run keeps (failures too with ``--keep-failed``)."""
        kept = [s for s in stored if self.options.keep_failed or not s.failed]
        return kept[: self.total]

    def open(self, stack: DemoStack, isolation: str) -> None:
        """Create (or, resuming, take) the run directory and write its first metadata."""
        opts = self.options
        self.stack = stack
        self.run_dir = RunDir.open(self.path) if opts.resume else RunDir.create(self.path)
        self.metadata = {
            "stack": stack.name,
            "env_id": stack.env_id,
            "model": opts.model or "scripted",
            "upstream": opts.upstream or "scripted model (built in)",
            "options": opts.recorded(),
            "versions": versions(),
            "isolation": isolation,
            "started_at": self.previous.get("started_at", self.started_at),
            "status": "running",
            "pid": os.getpid(),
            "counts": self.tally.counts(),
        }
        if opts.resume is not None:
            resumes = list(self.previous.get("resumes") or [])
            resumes.append(resume_entry(opts, self.started_at, self.total - self.tally.done))
            self.metadata["resumes"] = resumes
        self.write()

    def count_stored(self) -> None:
        """Count what the run directory holds once the stack planned against it."""
        if self.options.resume is None:
            return
        assert self.run_dir is not None and self.stack is not None
        self.summaries = self.kept(self.stack.stored(self.run_dir.path))
        self.tally = Tally(total=self.total)
        for summary in self.summaries:
            self.tally.add(summary)

    def add(self, summary: RolloutSummary) -> None:
        """Count one finished rollout (the stack wrote it down already)."""
        self.tally.add(summary)
        self.summaries.append(summary)
        self.write()

    def write(self) -> None:
        """Write ``metadata.json`` as it stands (nothing before the run directory exists)."""
        if self.run_dir is None:
            return
        self.metadata["counts"] = self.tally.counts()
        # The stack's keys (vf-eval's, on classic) first: the demo's own win a collision.
        extra = self.stack.metadata() if self.stack is not None else {}
        self.run_dir.write_metadata({**extra, **self.metadata})

    def finish(
        self, status: str, stopped: str | None, stop_reason: str | None, failure: str | None
    ) -> None:
        """Give the metadata its final status and print the report. ``stopped``: how the
        run was stopped early, as the report says it."""
        assert self.run_dir is not None
        duration = time.monotonic() - self.started
        self.metadata.update(
            status=status,
            finished_at=now_iso(),
            duration_s=round(float(self.previous.get("duration_s") or 0.0) + duration, 3),
        )
        if failure is not None:
            self.metadata["error"] = failure
        if stop_reason is not None:
            self.metadata["stopped_by"] = stop_reason
        self.metadata.pop("pid", None)
        self.write()
        self.run_dir.unlock()
        mean = self.tally.mean_reward
        lines = [
            ("status", status + (f" ({stopped})" if stopped else "")),
            ("rollouts", f"{self.tally.done}/{self.tally.total} done, {self.tally.failed} failed"),
            ("mean reward", f"{mean:.3f}" if mean is not None else "-"),
            ("elapsed", f"{duration:.1f} s"),
            ("isolation", str(self.metadata.get("isolation"))),
            ("run directory", f"{self.path}/"),
            ("files", ", ".join(p for p in self.run_dir.listing() if p.count("/") <= 1)),
        ]
        if self.tally.done < self.tally.total or self.tally.failed:
            lines.append(("resume with", resume_command(self.path)))
        print_summary(self.screen, self.summaries, lines)

    def report_nothing_to_run(self) -> int:
        """A resumed run whose rollouts all finished: say so, show them, and exit."""
        failed = sum(1 for s in self.summaries if s.failed)
        self.screen.line(
            f"nothing to resume in {self.path}: all {self.total} rollouts finished"
            + (f" ({failed} failed, kept with --keep-failed)" if failed else "")
        )
        rewards = [s.reward for s in self.summaries]
        lines = [
            ("status", str(self.previous.get("status", "completed"))),
            ("rollouts", f"{len(self.summaries)}/{self.total} done, {failed} failed"),
            ("mean reward", f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"),
            ("run directory", f"{self.path}/"),
        ]
        print_summary(self.screen, self.summaries, lines)
        return EXIT_FAILED_ROLLOUTS if failed else EXIT_OK


__all__ = ["EXIT_FAILED_ROLLOUTS", "EXIT_OK", "EXIT_TIMEOUT", "EXIT_USAGE", "RunRecord"]
