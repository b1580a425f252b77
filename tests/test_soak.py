"""The chaos soak's quick mode (``benchmarks/soak.py --quick``, issue 34), run whole: a
real deployment (scripted model with faults, three gateways on Redis behind HAProxy, a
SQLite gateway, env processes of both stacks on contained local sandboxes, hostile
agents) under every fault of the schedule, then the ledger: no rollout lost, no turn
duplicated or silently truncated, every failure typed, nothing left behind. About 4.5
minutes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak_report import cpu_by_part  # noqa: E402


def _requirements() -> str | None:
    for binary in ("redis-server", "haproxy"):
        if shutil.which(binary) is None and not os.path.exists(f"/usr/sbin/{binary}"):
            return f"{binary} is not installed"
    if os.geteuid() != 0:
        return "the soak mounts a tmpfs for the SQLite fill-up (root only)"
    from rollout_gateway.local_sandbox.isolation import available_modes

    return None if available_modes() else "no contained local sandbox mode on this host"


@pytest.mark.slow
def test_quick_soak_loses_duplicates_and_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    missing = _requirements()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick", "--seed", "34",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    ledger = report["ledger"]
    counts = ledger["counts"]
    for name in ("lost", "duplicated", "silently_truncated", "untyped"):
        assert counts.get(name, 0) == 0, (name, counts, ledger["errors"], ledger["examples"])
    assert counts["completed"] >= 3 and counts["steps"] >= 12  # it did work (loaded 2 cores: ~15)
    # The v1 stack's env process (when this checkout has its venv, as .ci/run makes it):
    # its rollouts are in the same ledger, held to the same zeros above.
    if "soak: no v1 env process" not in run.stdout:
        assert ledger["per_env"]["v1_0"]["completed"] >= 1, ledger["per_env"]
        assert any(e["what"] == "kill -9 env v1_0, resume" for e in report["chaos"])
    left = report["end_state"]
    for name in ("sandbox_dirs", "cgroups", "loop_mounts", "agent_processes"):
        assert left[name] == 0, (name, left)
    assert left["registered_rollouts_redis"] == 0, left
    assert not any(left["registered_rollouts_per_gateway"].values()), left  # no stale copy
    chaos = [event["what"] for event in report["chaos"]]
    assert sum(what.startswith("kill -9 gateway") for what in chaos) >= 3, chaos
    for fault in (
        "kill -9 env",
        "restart redis",
        "model outage",
        "fill the SQLite",
        "kill -9 the SQLite",
    ):
        assert any(what.startswith(fault) for what in chaos), (fault, chaos)
    cpu = report["cpu"]  # where each rollout's CPU went
    assert cpu["cpu_s"]["env processes"] > 0 and cpu["cpu_s"]["gateways on Redis"] > 0, cpu
    assert cpu["rest_cpu_s_per_rollout"] is not None, cpu
    assert run.returncode == 0, run.stdout[-4000:]


def test_cpu_by_part_sums_each_process_of_a_part_and_divides_by_the_rollouts() -> None:
    rows = [
        {"t": 0.0, "machine_cpu_s": 100.0, "gateway0.100.cpu_s": 1.0,
         "env_redis0.300.cpu_s": 2.0, "model.400.cpu_s": 1.0, "gateway0.100.rss_mb": 50.0},
        {"t": 10.0, "machine_cpu_s": 130.0, "gateway0.100.cpu_s": 3.0,
         "env_redis0.300.cpu_s": 4.0, "model.400.cpu_s": 2.0,
         "gateway2.200.cpu_s": 0.5},  # a gateway restarted (killed): a new pid
        {"t": 20.0, "machine_cpu_s": 150.0, "gateway2.200.cpu_s": 1.5,
         "env_v1_0.500.cpu_s": 7.0},  # one sample only: nothing measured of it
    ]  # fmt: skip
    cpu = cpu_by_part(rows, started=10, harness_cpu_s=0.5)
    assert cpu["cpu_s"] == {
        "env processes": 2.0, "gateways on Redis": 3.0, "scripted model": 1.0,
        "soak harness (canary, sampler)": 0.5,
    }  # fmt: skip
    assert cpu["total_cpu_s"] == 6.5 and cpu["total_cpu_s_per_rollout"] == 0.65
    assert cpu["cpu_s_per_rollout"]["gateways on Redis"] == 0.3
    # The machine was busy 50 CPU-s: 43.5 beyond the parts (agents, sandboxes, other work).
    assert cpu["machine_busy_cpu_s"] == 50.0 and cpu["rest_cpu_s_per_rollout"] == 4.35
    assert cpu["span_s"] == 20.0
