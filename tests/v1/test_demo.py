"""``rollout-gateway demo`` with verifiers 0.4 installed runs the v1 example in gateway mode."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from rollout_gateway.demo import DemoOptions, run_demo


def test_demo_runs_the_v1_example_through_the_gateway(tmp_path: Path) -> None:
    out = io.StringIO()
    output = tmp_path / "run"
    options = DemoOptions(examples=2, rollouts_per_example=1, concurrency=2, output=output)
    code = run_demo(options, out)
    text = out.getvalue()
    assert code == 0, text
    assert "verifiers v1" in text
    assert "2 rollouts, 0 failed, mean reward 1.00, branches per rollout [1, 1]" in text
    traces = [json.loads(line) for line in (output / "traces.jsonl").read_text().splitlines()]
    assert [t["ok"] for t in traces] == [True, True]


def _children() -> list[int]:
    """Live child processes of this test process (Linux /proc)."""
    me, children = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def test_demo_sends_max_tokens_on_every_call(tmp_path: Path) -> None:
    out = io.StringIO()
    options = DemoOptions(
        examples=1, rollouts_per_example=1, concurrency=1, output=tmp_path, max_tokens=64
    )
    assert run_demo(options, out) == 0, out.getvalue()
    [trace] = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert trace["calls"] and {c["sampling"]["max_tokens"] for c in trace["calls"]} == {64}


def test_demo_timeout_keeps_what_finished_and_exits_3(tmp_path: Path) -> None:
    before = set(_children())
    out = io.StringIO()
    options = DemoOptions(
        examples=2, rollouts_per_example=1, concurrency=2, output=tmp_path, timeout=0.01
    )
    code = run_demo(options, out)
    text = out.getvalue()
    assert code == 3, text
    assert "timed out after 0.01 s (--timeout): 0 of 2 rollouts finished" in text
    assert (tmp_path / "traces.jsonl").read_text() == ""
    assert set(_children()) <= before  # no agent process left running


def test_demo_refuses_the_options_it_cannot_honour(tmp_path: Path) -> None:
    out = io.StringIO()
    options = DemoOptions(resume=tmp_path, isolation="bwrap")
    assert run_demo(options, out) == 2
    text = out.getvalue()
    assert "--resume" in text and "--isolation" in text and "verifiers 0.4" in text
    assert "rollout gateway" not in text  # refused before anything started
