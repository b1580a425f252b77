"""Prometheus metrics of the gateway (text exposition format, no dependency)."""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Mapping, Sequence

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    inner = ",".join(
        f'{n}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for n, v in zip(names, values, strict=True)
    )
    return "{" + inner + "}"


class Counter:
    """A monotonically increasing counter, optionally labelled."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        """Add ``amount`` to the series with these label values."""
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        """Current value of one series."""
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        """Exposition lines."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self._values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, key)} {value:g}")
        return lines


class Gauge:
    """A gauge whose value is read from a callback at scrape time."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name, self.help, self.read = name, help_text, read

    def render(self) -> list[str]:
        """Exposition lines."""
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} gauge",
            f"{self.name} {self.read():g}",
        ]


class LabelledGauge:
    """Gauges read at scrape time from one callback: label values -> value."""

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str],
        read: Callable[[], Mapping[tuple[str, ...], float]],
    ) -> None:
        self.name, self.help, self.label_names, self.read = name, help_text, tuple(labels), read

    def render(self) -> list[str]:
        """Exposition lines."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        for key, value in sorted(self.read().items()):
            lines.append(f"{self.name}{_labels(self.label_names, key)} {value:g}")
        return lines


def _process_numbers() -> dict[str, float]:
    """This process's resident memory (bytes), open file descriptors and threads, from
    ``/proc`` (Linux; empty elsewhere). Cheap: three small reads per scrape."""
    try:
        with open("/proc/self/statm", "rb") as f:
            rss_pages = int(f.read().split()[1])
        fds = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/status", "rb") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith(b"Threads:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return {}
    return {
        "process_resident_memory_bytes": float(rss_pages * os.sysconf("SC_PAGE_SIZE")),
        "process_open_fds": float(fds),
        "process_threads": float(threads),
    }


_PROCESS_HELP = {
    "process_resident_memory_bytes": "Resident memory of the gateway process, in bytes.",
    "process_open_fds": "File descriptors the gateway process holds open.",
    "process_threads": "Threads of the gateway process.",
}


def render_process_metrics() -> list[str]:
    """The ``process_*`` exposition lines (the names Prometheus's own clients use)."""
    lines: list[str] = []
    for name, value in _process_numbers().items():
        lines += [
            f"# HELP {name} {_PROCESS_HELP[name]}",
            f"# TYPE {name} gauge",
            f"{name} {value:g}",
        ]
    return lines


class Histogram:
    """A histogram with fixed buckets, labelled by one or more labels."""

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = _LATENCY_BUCKETS_S,
    ) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self.buckets = tuple(buckets)
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        """Record one observation."""
        counts, total = self._series.setdefault(labels, ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        total[0] += value

    def count(self, *labels: str) -> int:
        """Number of observations of one series."""
        series = self._series.get(labels)
        return sum(series[0]) if series else 0

    def render(self) -> list[str]:
        """Exposition lines (cumulative buckets, ``_sum`` and ``_count``)."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, (counts, total) in sorted(self._series.items()):
            cumulative = 0
            for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                labels = _labels((*self.label_names, "le"), (*key, le))
                lines.append(f"{self.name}_bucket{labels} {cumulative}")
            base = _labels(self.label_names, key)
            lines.append(f"{self.name}_sum{base} {total[0]:g}")
            lines.append(f"{self.name}_count{base} {cumulative}")
        return lines


class GatewayMetrics:
    """The gateway's metrics. ``active_rollouts`` is read from the registry at scrape."""

    def __init__(
        self,
        active_rollouts: Callable[[], float],
        *,
        healthy: Callable[[], float] = lambda: 1.0,
        dependencies_up: Callable[[], Mapping[tuple[str, ...], float]] = dict,
    ) -> None:
        self.active_rollouts = Gauge(
            "rollout_gateway_active_rollouts", "Rollouts currently registered.", active_rollouts
        )
        self.healthy = Gauge(
            "rollout_gateway_healthy",
            "1 while /health answers 200 (the store and an upstream answer), else 0.",
            healthy,
        )
        self.dependency_up = LabelledGauge(
            "rollout_gateway_dependency_up",
            "1 while the last health probe reached the dependency, else 0, by kind "
            "(upstream, store) and where (URL without credentials, store backend).",
            ["kind", "where"],
            dependencies_up,
        )
        self._declare_event_metrics()

    def _declare_event_metrics(self) -> None:
        """The counters and the latency histogram, which the gateway's code paths add to."""
        self.registrations = Counter("rollout_gateway_registrations_total", "Rollouts registered.")
        self.turns = Counter(
            "rollout_gateway_turns_total", "Chat turns completed, by upstream.", ["upstream"]
        )
        self.upstream_latency = Histogram(
            "rollout_gateway_upstream_latency_seconds",
            "Latency of upstream chat completions, by upstream.",
            ["upstream"],
        )
        self.upstream_errors = Counter(
            "rollout_gateway_upstream_errors_total",
            "Failed upstream calls, by upstream and kind "
            "(connect, timeout, http_4xx, http_5xx, protocol).",
            ["upstream", "kind"],
        )
        self.expired_rollouts = Counter(
            "rollout_gateway_expired_rollouts_total", "Rollouts dropped after the idle TTL."
        )
        self.rejected_requests = Counter(
            "rollout_gateway_rejected_requests_total",
            "Requests answered with a 4xx/5xx by the gateway itself, by status.",
            ["status"],
        )
        self.internal_errors = Counter(
            "rollout_gateway_internal_errors_total",
            "Unexpected errors of the gateway itself (answered 500; details in its log).",
        )
        self.refused_turns = Counter(
            "rollout_gateway_refused_turns_total",
            "Chat turns refused by a rollout's state or budgets, by error code.",
            ["code"],
        )
        self.deduplicated_requests = Counter(
            "rollout_gateway_deduplicated_requests_total",
            "Retried requests answered from the turn they repeat (not new turns).",
        )
        self.abandoned_turns = Counter(
            "rollout_gateway_abandoned_turns_total",
            "Turns whose answer reached no client (recorded as abandoned).",
        )

    def render(self) -> str:
        """The whole exposition text."""
        lines: list[str] = []
        for metric in (
            self.healthy,
            self.dependency_up,
            self.active_rollouts,
            self.registrations,
            self.turns,
            self.upstream_latency,
            self.upstream_errors,
            self.expired_rollouts,
            self.rejected_requests,
            self.internal_errors,
            self.refused_turns,
            self.deduplicated_requests,
            self.abandoned_turns,
        ):
            lines.extend(metric.render())
        lines.extend(render_process_metrics())
        return "\n".join(lines) + "\n"


__all__ = [
    "Counter",
    "Gauge",
    "GatewayMetrics",
    "Histogram",
    "LabelledGauge",
    "render_process_metrics",
]
