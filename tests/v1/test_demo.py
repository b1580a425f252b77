"""``rollout-gateway demo`` with verifiers 0.4 installed runs the v1 example in gateway mode."""

from __future__ import annotations

import io
import json
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
