"""``rollout-gateway demo``: the real local stack, small, through the CLI entry point."""

from __future__ import annotations

import json

from rollout_gateway.cli import main


def test_demo_runs_the_example_end_to_end_and_writes_results(tmp_path, capsys):
    output = tmp_path / "results.jsonl"
    code = main(
        [
            "demo",
            "--examples",
            "2",
            "--rollouts-per-example",
            "1",
            "--concurrency",
            "2",
            "--temperature",
            "0",
            "--output",
            str(output),
            "--timeout",
            "120",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "summary" in printed and str(output) in printed
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["error"] is None
        assert row["reward"] == 1.0  # temperature 0: the scripted fix is the right one
        steps = row["trajectory"]
        assert len(steps) >= 2
        for step in steps:
            tokens = step["tokens"]
            assert tokens["prompt_ids"] and tokens["completion_ids"]
            assert len(tokens["completion_logprobs"]) == len(tokens["completion_ids"])


def test_demo_refuses_bad_options_with_a_clear_message(capsys):
    assert main(["demo", "--upstream", "http://127.0.0.1:9/v1"]) == 2
    assert "--upstream needs --model" in capsys.readouterr().out
