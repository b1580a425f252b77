"""The pure helpers of ``benchmarks/gateway_overhead.py`` (its figures are not tested:
speed is measured by running it, never by timed tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gateway_overhead.py"
_spec = importlib.util.spec_from_file_location("gateway_overhead_benchmark", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses resolve their module by name
_spec.loader.exec_module(bench)


def test_merge_client_reports_concatenates_latencies_and_sums_cpu() -> None:
    reports = [
        {"latencies_s": [0.1, 0.2], "cpu_s": 0.5},
        {"latencies_s": [0.3], "cpu_s": 0.25},
    ]
    totals = bench.merge_client_reports(reports, expected_turns=3)
    assert sorted(totals.latencies_s) == [0.1, 0.2, 0.3]
    assert totals.cpu_s == pytest.approx(0.75)


def test_merge_client_reports_refuses_a_round_with_lost_turns() -> None:
    reports = [{"latencies_s": [0.1, 0.2], "cpu_s": 0.5}, {"latencies_s": [], "cpu_s": 0.1}]
    with pytest.raises(ValueError, match="2 turns, expected 4"):
        bench.merge_client_reports(reports, expected_turns=4)


def test_split_agents_gives_every_agent_to_exactly_one_client() -> None:
    agents = [bench.Agent(f"/v1/rollouts/r{i}/chat/completions", f"k{i}") for i in range(10)]
    shares = bench.split_agents(agents, 4)
    assert [len(s) for s in shares] == [3, 3, 2, 2]
    assert sorted(a.key for s in shares for a in s) == sorted(a.key for a in agents)
    # Never an empty client: one rollout means one client, whatever --clients says.
    assert bench.split_agents(agents[:1], 4) == [agents[:1]]


def test_ratio_of_a_non_positive_extra_is_not_a_number() -> None:
    assert bench._ratio(1.5, 1.0) == "1.50x"
    assert bench._ratio(0.2, -0.1) == "n/a"


def test_rounds_cover_the_minimum_turns_and_are_never_zero() -> None:
    assert bench.rounds_for(640, 1, 40) == 16
    assert bench.rounds_for(640, 64, 40) == 1
    assert bench.rounds_for(641, 1, 40) == 17
    assert bench.rounds_for(0, 1, 40) == 1


def test_merge_run_adds_a_round_and_keeps_the_first_trajectory() -> None:
    total = bench.RunResult([], 0.0, {})
    first = bench.RunResult([0.1], 1.0, {"gateway": 0.5, "model": 0.25}, (0.01, 10, 0.001, 1))
    second = bench.RunResult([0.2, 0.3], 2.0, {"gateway": 0.5}, (0.02, 20, 0.002, 2), 0.5)
    bench.merge_run(total, first)
    assert bench.merge_run(total, second) is total
    assert total.latencies_s == [0.1, 0.2, 0.3]
    assert total.wall_s == pytest.approx(3.0)
    assert total.cpu_s == pytest.approx({"gateway": 1.0, "model": 0.25})
    assert total.loadgen_cpu_s == pytest.approx(0.5)
    assert total.trajectory == (0.01, 10, 0.001, 1)
