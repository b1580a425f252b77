"""How often to ask a sandbox whether the agent has exited.

The sandbox API offers no push, so completion is polled. A fixed interval either wastes
calls (short) or adds its whole length to every rollout (long: verifiers' default is
5 s). :class:`PollPolicy` polls at an interval proportional to the time the agent has
already run: the detection delay stays a small fraction of the rollout's own duration
(5% by default), a quick agent is noticed within ~50 ms, and a long-running one is asked
at most about once a second.
"""

from __future__ import annotations

from dataclasses import dataclass


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


__all__ = ["PollPolicy"]
