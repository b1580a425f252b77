"""How often to ask a sandbox whether the agent has exited.

The sandbox API offers no push, so completion is polled. A fixed interval either wastes
calls (short) or adds its whole length to every rollout (long: verifiers' default is
5 s). :class:`PollPolicy` polls at an interval proportional to the time the agent has
already run: the detection delay stays a small fraction of the rollout's own duration
(5% by default), a quick agent is noticed within ~50 ms, and a long-running one is asked
at most about once a second.

:class:`ExitPollPlan` decides, for one agent, when to wait and when to ask the sandbox,
from what the exit channel (:mod:`rollout_gateway.exits`) said: events in (a report or
none, the sandbox's answer), steps out (wait so long, probe, stop the agent). It is pure:
no clock, no I/O; :func:`rollout_gateway.agent_wait.poll_until_exit` runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class PollPolicy:
    """Adaptive poll interval: ``clamp(elapsed * elapsed_fraction, min, max)`` seconds.

    ``max_consecutive_read_errors`` transient read errors in a row (timeouts, 502/503 of
    the sandbox API) are tolerated before polling fails the rollout.

    When the gateway reports agent exits (see :mod:`rollout_gateway.exits`), the sandbox
    is asked only every ``safety_interval`` seconds, as a safety net for an agent that
    died without reporting, plus once to confirm a report. That holds once the launch
    wrapper's start report is heard; a rollout that hears none within ``start_grace``
    seconds (an image without an HTTP client) is polled adaptively, as without reports.
    """

    min_interval: float = 0.05
    max_interval: float = 1.0
    elapsed_fraction: float = 0.05
    max_consecutive_read_errors: int = 5
    safety_interval: float = 10.0
    start_grace: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.min_interval <= self.max_interval:
            raise ValueError("PollPolicy needs 0 < min_interval <= max_interval")
        if self.elapsed_fraction < 0:
            raise ValueError("PollPolicy.elapsed_fraction must be non-negative")
        if self.safety_interval <= 0:
            raise ValueError("PollPolicy.safety_interval must be positive")
        if self.start_grace < 0:
            raise ValueError("PollPolicy.start_grace must be non-negative")
        if self.max_consecutive_read_errors < 1:
            raise ValueError("PollPolicy.max_consecutive_read_errors must be at least 1")

    def interval(self, elapsed: float) -> float:
        """Seconds to wait before the next poll, ``elapsed`` seconds after the agent start."""
        return min(self.max_interval, max(self.min_interval, elapsed * self.elapsed_fraction))


@dataclass(frozen=True)
class PollStep:
    """What to do next: ``wait`` ``seconds`` (or less, if a report comes first), ``probe``
    the sandbox, or ``stop`` the agent (the gateway refused a turn) and then probe."""

    action: Literal["wait", "probe", "stop"]
    seconds: float = 0.0


PROBE = PollStep("probe")
STOP = PollStep("stop")


@dataclass
class ExitPollPlan:
    """When to wait and when to ask the sandbox whether one agent exited.

    - the launch wrapper's ``started`` report came (and the gateway has reports): its exit
      will be reported, so the sandbox is asked only every ``safety_interval`` s, and once
      to confirm a report;
    - no report can be relied on (no reporting wrapper: an env's own ``start_agent``; a
      gateway without reports; no ``started`` within ``start_grace`` s: an image without
      curl, wget or python3; a report the sandbox did not confirm): the sandbox is polled
      adaptively (:meth:`PollPolicy.interval`);
    - the gateway ``refused`` a turn: the agent is stopped at once, then the sandbox asked
      (an agent may retry a refused turn for minutes).

    Args:
        policy: the intervals.
        started: when the wait started (the caller's clock).
        watching: whether the exit channel is watched at all.
        expect: whether an exit report can come (the agent runs behind the wrapper).

    Every method takes ``now`` (the caller's clock) and ``supported``: whether the
    gateway has exit reports (``None`` until it answered once).
    """

    policy: PollPolicy
    started: float
    watching: bool
    expect: bool
    heard_start: bool = False
    #: Transient probe failures in a row.
    read_errors: int = 0

    def first(self) -> PollStep:
        """The first wait: short either way (a quick agent's exit report, or the gateway's
        first answer, whether it has reports at all, usually comes within it)."""
        seconds = self.policy.min_interval if self.watching else self.policy.interval(0.0)
        return PollStep("wait", seconds)

    def heard(
        self,
        report: Mapping[str, Any] | None,
        *,
        now: float,
        supported: bool | None,
        refused: bool,
    ) -> PollStep:
        """A wait ended with ``report`` (``None``: it elapsed); ``refused``: a refusal was
        already acted on."""
        if report is not None and report.get("refused") and not refused:
            self.expect = False
            return STOP
        if report is not None and (report.get("started") or report.get("exit_code") is None):
            # A start report (a gateway that predates "started" passes the wrapper's start
            # on as an exit code of null, which no exit report of it carries).
            self.heard_start = True
            return self._wait(now, supported)
        if report is None and self.expect and not self.heard_start:
            if now - self.started < self.policy.start_grace and supported is not False:
                return self._wait(now, supported)  # still waiting for the start report
        return PROBE

    def probed(
        self, report: Mapping[str, Any] | None, *, now: float, supported: bool | None
    ) -> PollStep:
        """The sandbox says the agent still runs (after ``report``, the one that led here)."""
        self.read_errors = 0
        return self._after_probe(report, now, supported)

    def probe_failed(
        self, report: Mapping[str, Any] | None, *, now: float, supported: bool | None
    ) -> PollStep | None:
        """Asking the sandbox failed transiently; ``None`` once that happened
        ``max_consecutive_read_errors`` times in a row (the wait fails)."""
        self.read_errors += 1
        if self.read_errors >= self.policy.max_consecutive_read_errors:
            return None
        return self._after_probe(report, now, supported)

    def _after_probe(
        self, report: Mapping[str, Any] | None, now: float, supported: bool | None
    ) -> PollStep:
        if report is not None and not report.get("refused"):
            self.expect = False  # a report the sandbox did not confirm: poll from now on
        return self._wait(now, supported)

    def _wait(self, now: float, supported: bool | None) -> PollStep:
        elapsed = now - self.started
        policy = self.policy
        if self.expect and supported is not False:
            if self.heard_start and supported:
                return PollStep("wait", policy.safety_interval)
            if not self.heard_start and elapsed < policy.start_grace:
                return PollStep("wait", max(policy.min_interval, policy.start_grace - elapsed))
        return PollStep("wait", policy.interval(elapsed))


__all__ = ["ExitPollPlan", "PollPolicy", "PollStep"]
