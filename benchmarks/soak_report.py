"""What the chaos soak (``benchmarks/soak.py``) reports: the ledger check, the curves'
slopes, the CSV and the PNG. Pure functions of the run's files (no server needed), so a
run directory can be checked again: ``python benchmarks/soak_report.py RUN_DIR``.

The ledger check (issue 34): the scripted model's ledger (``model-ledger.jsonl``: one line
per completion served whole, its serial and a digest of its completion ids) against the
env journals (``env-*.jsonl``: each rollout's outcome and, per recorded step, the
serial and digest the gateway recorded):

* **lost**: a rollout started and never ended, by an env process that was not killed
  (a killed env's rollouts are *interrupted* and run again on ``--resume``; those still
  running when the env stops, past its ``--drain-s``, are *cancelled at the stop*);
* **duplicated**: a served completion recorded in two steps (of one rollout or two);
* **silently truncated**: a step whose completion differs from what the model served,
  a step with no serial or one the model never served, or an example agent that
  finished cleanly with fewer turns than its script (4) and no error said why;
* **untyped**: a rollout failed with an error that is not verifiers' typed ``vf.Error``.

All four must be 0.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Turns of the example agent's script (look, fix, test, report: ``tasks.script_for``).
SCRIPT_TURNS = 4


def read_lines(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's objects (a line cut by a kill -9 is skipped)."""
    out = []
    if not path.exists():
        return out
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return out


def ledger_check(run_dir: Path) -> dict[str, Any]:
    """The ledger's counts (see the module doc)."""
    served = {
        line["call"]: line["completion"] for line in read_lines(run_dir / "model-ledger.jsonl")
    }
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    seen: dict[int, str] = {}
    examples: dict[str, list[str]] = defaultdict(list)
    open_keys: dict[str, dict[str, Any]] = {}
    per_env: dict[str, Counter[str]] = defaultdict(Counter)
    for journal in sorted(run_dir.glob("env-*.jsonl")):
        for line in read_lines(journal):
            key = line.get("rollout_key", "")
            event = line.get("event")
            if event in ("start", "end"):
                env = per_env[str(line.get("env"))]
                env["started" if event == "start" else "ended"] += 1
                env["completed"] += event == "end" and line.get("error") is None
            if event == "start":
                counts["started"] += 1
                open_keys[key] = line
            elif event == "interrupted":
                counts["interrupted_by_env_kill"] += 1
                open_keys.pop(key, None)
            elif event == "cancelled":
                counts["cancelled_at_the_stop"] += 1
                open_keys.pop(key, None)
            elif event == "end":
                open_keys.pop(key, None)
                _check_end(line, served, seen, counts, errors, examples)
    counts["lost"] = len(open_keys)
    examples["lost"] = list(open_keys)[:5]
    counts["served"] = len(served)
    counts["served_not_in_a_trajectory"] = len(set(served) - set(seen))
    return {
        "counts": dict(counts),
        "per_env": {name: dict(c) for name, c in sorted(per_env.items())},
        "errors": dict(errors.most_common()),
        "examples": {k: v[:5] for k, v in examples.items() if v},
        "ok": all(counts[k] == 0 for k in ("lost", "duplicated", "silently_truncated", "untyped")),
    }


def _check_end(
    line: dict[str, Any],
    served: dict[int, str],
    seen: dict[int, str],
    counts: Counter[str],
    errors: Counter[str],
    examples: dict[str, list[str]],
) -> None:
    rollout = str(line.get("rollout_id") or line.get("rollout_key"))
    error, hostile = line.get("error"), line.get("hostile")
    counts["ended"] += 1
    counts["hostile" if hostile else "example_agent"] += 1
    if error is None:
        counts["completed"] += 1
    else:
        counts["failed_typed" if line.get("typed") else "untyped"] += 1
        errors[f"{error}{' (hostile ' + hostile + ')' if hostile else ''}"] += 1
        if not line.get("typed"):
            examples["untyped"].append(f"{rollout}: {error}: {line.get('error_message')}")
    steps = line.get("steps") or []
    counts["steps"] += len(steps)
    for step in steps:
        call = step.get("call")
        if call is None or call not in served or served[call] != step.get("digest"):
            counts["silently_truncated"] += 1
            examples["silently_truncated"].append(f"{rollout}: step call={call}")
        elif call in seen:
            counts["duplicated"] += 1
            examples["duplicated"].append(f"{rollout} and {seen[call]}: call={call}")
        if call is not None:
            seen[call] = rollout
    clean = error is None and not hostile and line.get("agent_exit") == 0
    if clean and len(steps) != SCRIPT_TURNS:
        counts["silently_truncated"] += 1
        examples["silently_truncated"].append(f"{rollout}: {len(steps)} of {SCRIPT_TURNS} turns")


# -- curves ----------------------------------------------------------------------------------


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """The samples, one row per 10 s, one column per series (empty where absent)."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict[str, float]]:
    """:func:`write_csv`'s rows back, numbers as floats (absent values dropped)."""
    with path.open(encoding="utf-8") as src:
        return [
            {k: float(v) for k, v in row.items() if v not in ("", None)}
            for row in csv.DictReader(src)
        ]


def slope(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope of ``(t, y)`` and the mean of ``y`` (``None`` under 6 points)."""
    pts = list(points)
    if len(pts) < 6:
        return None
    ts, ys = [p[0] for p in pts], [p[1] for p in pts]
    mean_t, mean_y = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mean_t) ** 2 for t in ts)
    if var == 0:
        return None
    return sum((t - mean_t) * (y - mean_y) for t, y in pts) / var, mean_y


def slopes(rows: list[dict[str, float]], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per series of a process (``<role>.<pid>.rss_mb|fds|threads``), after ``warmup_s``
    of the run (or of the process's life, for one restarted): the fitted slope per hour,
    as a share of the series' mean (the issue's target: under 1 % per hour)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        for name, value in row.items():
            if name.count(".") == 2 and name.rsplit(".", 1)[1] in ("rss_mb", "fds", "threads"):
                series[name].append((row["t"], value))
    out: dict[str, dict[str, float]] = {}
    for name, points in sorted(series.items()):
        born = points[0][0]
        kept = [(t, y) for t, y in points if t >= max(warmup_s, born + warmup_s / 2)]
        fit = slope(kept)
        if fit is None or fit[1] == 0:
            continue
        per_hour, mean = fit[0] * 3600, fit[1]
        out[name] = {
            "per_hour": round(per_hour, 3),
            "pct_per_hour": round(100 * per_hour / mean, 3),
            "mean": round(mean, 3),
            "minutes": round((kept[-1][0] - kept[0][0]) / 60, 1),
        }
    return out


#: The deployment's parts, by the role a sample names a process with.
_PARTS = (
    ("env_", "env processes"),
    ("gateway", "gateways on Redis"),
    ("sqlite_gateway", "SQLite gateway"),
    ("model", "scripted model"),
    ("redis", "redis-server"),
    ("haproxy", "HAProxy"),
)


def _part_of(role: str) -> str:
    for prefix, name in _PARTS:
        if role == prefix or (prefix in ("env_", "gateway") and role[: len(prefix)] == prefix):
            return name
    return role


def cpu_by_part(rows: list[dict[str, Any]], started: int, harness_cpu_s: float) -> dict[str, Any]:
    """CPU seconds each part of the deployment used over the run, in all and per rollout
    started, and the machine's busy CPU seconds over the same samples beyond them: the
    agents and their sandboxes (whose CPU no process's counters hold), and on a shared
    machine any other work. From the samples, so what a process used after its last one
    (at most ``SAMPLE_EVERY_S`` before a ``kill -9``) is not counted."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for row in rows:
        for name, value in row.items():
            if name.count(".") == 2 and name.endswith(".cpu_s"):
                first.setdefault(name, value)
                last[name] = value
    used: dict[str, float] = defaultdict(float)
    for name, value in last.items():
        used[_part_of(name.split(".")[0])] += value - first[name]
    used["soak harness (canary, sampler)"] = harness_cpu_s
    busy = [row["machine_cpu_s"] for row in rows if "machine_cpu_s" in row]
    total = sum(used.values())
    machine = busy[-1] - busy[0] if len(busy) > 1 else None
    per = max(started, 1)
    return {
        "started": started,
        "cpu_s": {name: round(value, 1) for name, value in sorted(used.items())},
        "cpu_s_per_rollout": {name: round(value / per, 3) for name, value in sorted(used.items())},
        "total_cpu_s": round(total, 1),
        "total_cpu_s_per_rollout": round(total / per, 3),
        "machine_busy_cpu_s": None if machine is None else round(machine, 1),
        "rest_cpu_s_per_rollout": None if machine is None else round((machine - total) / per, 3),
        "span_s": round(rows[-1]["t"] - rows[0]["t"], 1) if rows else 0.0,
    }


def latency_by_minute(canary: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Turn latency p50 / p99 (ms) of the canary's successful turns, per minute of run."""
    by_minute: dict[int, list[float]] = defaultdict(list)
    for turn in canary:
        if turn.get("status") == 200:
            by_minute[int(turn["t"] // 60)].append(turn["ms"])
    out = []
    for minute, values in sorted(by_minute.items()):
        values.sort()
        out.append(
            {
                "minute": minute,
                "turns": len(values),
                "p50_ms": round(values[len(values) // 2], 2),
                "p99_ms": round(values[min(len(values) - 1, int(len(values) * 0.99))], 2),
            }
        )
    return out


def latency_drift(
    canary: list[dict[str, Any]], window_min: int, injected_slow_ms: float | None = None
) -> dict[str, float] | None:
    """p50 and p99 of the last ``window_min`` minutes over the first ``window_min``'s
    (target: p99 within 1.2x). ``injected_slow_ms``: the model's own slow answers (its
    ``--fault-slow-s``) are left out of a second pair of figures: at a 1 % slow rate the
    p99 of a minute is the injected delay whenever one lands in it, which says nothing of
    the gateway."""
    ok = [c for c in canary if c.get("status") == 200]
    if not ok:
        return None
    end = max(c["t"] for c in ok)

    def pick(p: float, values: list[float]) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(len(values) * p))] if values else float("nan")

    first = [c["ms"] for c in ok if c["t"] < window_min * 60]
    last = [c["ms"] for c in ok if c["t"] >= end - window_min * 60]
    out = {"window_min": float(window_min)}
    for name, keep in (("", lambda v: True), ("_without_injected_slow", None)):
        if keep is None:
            if injected_slow_ms is None:
                continue
            bound = injected_slow_ms * 0.95
            a, b = [v for v in first if v < bound], [v for v in last if v < bound]
        else:
            a, b = first, last
        for p, label in ((0.5, "p50"), (0.99, "p99")):
            x, y = pick(p, a), pick(p, b)
            out[f"first_{label}_ms{name}"] = round(x, 2)
            out[f"last_{label}_ms{name}"] = round(y, 2)
            out[f"{label}_ratio{name}"] = round(y / x, 3)
    return out


# -- the picture ------------------------------------------------------------------------------


def draw(
    run_dir: Path,
    rows: list[dict[str, float]],
    events: list[dict[str, Any]],
    canary: list[dict[str, Any]],
    health: list[dict[str, Any]] | None = None,
) -> Path | None:
    """``curves.png``: memory, fds, threads per process; sandboxes and kernel objects;
    state sizes; turn latency per minute; each gateway's ``/health``; the chaos events as
    vertical lines (red: a kill). ``None`` when matplotlib is not installed (the ``soak``
    extra: ``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(4, 2, figsize=(16, 17), sharex=True)
    for ax, title, suffix in (
        (axes[0][0], "RSS (MiB) per process", ".rss_mb"),
        (axes[0][1], "open fds per process", ".fds"),
        (axes[1][0], "threads per process", ".threads"),
    ):
        _per_process(ax, rows, suffix)
        ax.set_title(title)
    _series(
        axes[1][1],
        rows,
        ("sandboxes", "sandbox_dirs", "cgroups", "loop_mounts", "rollouts_running"),
    )
    axes[1][1].set_title("live sandboxes, their kernel objects, rollouts running")
    _series(axes[2][0], rows, ("sqlite_db_mb", "sqlite_wal_mb", "redis_used_mb", "redis_keys_k"))
    axes[2][0].set_title("SQLite file and WAL (MiB), Redis memory (MiB) and keys (thousands)")
    _latency(axes[2][1], canary)
    _health(axes[3][0], health or [], rows[-1]["t"] if rows else 0.0)
    _completions(axes[3][1], run_dir)
    for ax in axes.flat:
        for event in events:
            color = "red" if "kill" in event["what"] else "grey"
            ax.axvline(event["t"] / 60, color=color, alpha=0.35, lw=0.8)
    for event in events:
        axes[0][0].annotate(
            event["what"], (event["t"] / 60, 0), rotation=90, fontsize=5,
            xycoords=("data", "axes fraction"), va="bottom",
        )  # fmt: skip
    for ax in axes[3]:
        ax.set_xlabel("minutes")
    fig.tight_layout()
    path = run_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _per_process(ax: Any, rows: list[dict[str, float]], suffix: str) -> None:
    names = sorted({k for r in rows for k in r if k.endswith(suffix) and k.count(".") == 2})
    for name in names:
        points = [(r["t"] / 60, r[name]) for r in rows if name in r]
        ax.plot(*zip(*points, strict=True), lw=1, label=name.rsplit(".", 1)[0])
    ax.legend(fontsize=6, ncol=2)


def _series(ax: Any, rows: list[dict[str, float]], names: tuple[str, ...]) -> None:
    for name in names:
        ax.plot([r["t"] / 60 for r in rows], [r.get(name, 0) for r in rows], lw=1, label=name)
    ax.legend(fontsize=7)


def _latency(ax: Any, canary: list[dict[str, Any]]) -> None:
    per_minute = latency_by_minute(canary)
    for key in ("p50_ms", "p99_ms"):
        xs = [m["minute"] + 0.5 for m in per_minute]
        ax.plot(xs, [m[key] for m in per_minute], marker="o", lw=1, label=key)
    failed = [c["t"] / 60 for c in canary if c.get("status") != 200]
    ax.plot(failed, [1.0] * len(failed), "x", color="red", ms=3, label="turn failed")
    ax.set_yscale("log")
    ax.set_title("turn latency per minute (ms, the canary through HAProxy)")
    ax.legend(fontsize=7)


def _health(ax: Any, health: list[dict[str, Any]], end: float) -> None:
    """Each gateway's /health over time: 200 up, 503 not ready, 0 no answer."""
    for offset, name in enumerate(("gateway0", "gateway1", "gateway2", "sqlite")):
        changes = [h for h in health if h["gateway"] == name]
        if not changes:
            continue
        xs = [h["t"] / 60 for h in changes] + [end / 60]
        level = {200: 1.0, 503: 0.5, 0: 0.0}
        ys = [level.get(h["status"], 0.25) + offset * 1.5 for h in changes]
        ax.step(xs, [*ys, ys[-1]], where="post", lw=1.2, label=name)
    ax.set_yticks([])
    ax.set_title("/health per gateway (high 200, middle 503, low no answer)")
    ax.legend(fontsize=7)


def _completions(ax: Any, run_dir: Path) -> None:
    """Rollouts ended per minute, by outcome (from the env journals)."""
    by: dict[str, Counter[int]] = defaultdict(Counter)
    starts = [
        line["at"] for j in run_dir.glob("env-*.jsonl") for line in read_lines(j)
        if line.get("event") == "start"
    ]  # fmt: skip
    origin = min(starts, default=0.0)
    for journal in run_dir.glob("env-*.jsonl"):
        for line in read_lines(journal):
            if line.get("event") == "end":
                outcome = "completed" if line.get("error") is None else "failed (typed)"
                by[outcome][int((line["at"] - origin) // 60)] += 1
    for outcome, counts in sorted(by.items()):
        minutes = sorted(counts)
        ax.plot(
            [m + 0.5 for m in minutes],
            [counts[m] for m in minutes],
            marker="o",
            lw=1,
            label=outcome,
        )
    ax.set_title("rollouts ended per minute")
    ax.legend(fontsize=7)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Check a soak run directory again.")
    parser.add_argument("run_dir", type=Path, help="a benchmarks/soak.py --out directory")
    parser.add_argument("--warmup-s", type=float, default=300.0, help="left out of the slopes")
    parser.add_argument(
        "--fault-slow-s", type=float, default=3.0, help="the run's injected slow answers"
    )
    args = parser.parse_args()
    print(json.dumps(ledger_check(args.run_dir), indent=2))
    rows = read_csv(args.run_dir / "samples.csv")
    print(json.dumps(slopes(rows, args.warmup_s), indent=2))
    canary = read_csv(args.run_dir / "canary.csv")
    minutes = (canary[-1]["t"] if canary else 0.0) / 60
    window = 10 if minutes >= 25 else max(1, int(minutes // 3))
    drift = latency_drift(canary, window, injected_slow_ms=args.fault_slow_s * 1000)
    print(json.dumps(drift, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
