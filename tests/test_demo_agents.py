"""``rollout-gateway demo --agent claude-code|codex`` on the installed verifiers stack
(both stacks run this module): the real CLI in each contained sandbox, driven by the
scripted model through its own shell tool, every turn in the CLI's dialect; a missing
CLI is one line saying how to install it, with nothing created."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from agent_clis.support import program_of
from stacks import STACK

from rollout_gateway.agent_clis import AGENT_CLIS
from rollout_gateway.cli import main

pytestmark = pytest.mark.skipif(STACK == "none", reason="needs a verifiers stack")

#: Each CLI's shell tool, which the scripted model's run_shell steps call.
SHELL_TOOL = {"claude-code": "Bash", "codex": "exec_command"}


@pytest.fixture
def sandbox_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT", str(root))
    return root


def turns(out: Path) -> list[dict[str, Any]]:
    """Each recorded turn: its dialect and the tool calls the model made."""
    found = []
    if STACK == "classic":
        for line in (out / "results.jsonl").read_text().splitlines():
            for step in json.loads(line)["trajectory"]:
                calls = step["completion"][0].get("tool_calls") or []
                dialect = step["extras"]["dialect"]
                found.append({"dialect": dialect, "tools": [c["name"] for c in calls]})
        return found
    for line in (out / "traces.jsonl").read_text().splitlines():
        for trace in json.loads(line)["traces"]:
            for call in trace["calls"]:
                node = trace["nodes"][call["node"]]
                calls = node["message"].get("tool_calls") or []
                found.append({"tools": [c["name"] for c in calls], "sampled": node["sampled"]})
    return found


@pytest.mark.parametrize("name", list(AGENT_CLIS))
def test_the_demo_runs_the_real_cli_on_the_example_tasks(
    name: str, tmp_path: Path, sandbox_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = AGENT_CLIS[name]
    program = program_of(cli)
    out = tmp_path / "run"
    args = ["demo", "--agent", name, "--examples", "1", "--rollouts-per-example", "1"]
    code = main([*args, "--temperature", "0", "--output", str(out), "--timeout", "200"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert f"agent           {name} {cli.version} ({program})" in printed
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["options"]["agent"] == name
    assert meta["counts"]["done"] == 1 and meta["counts"]["mean_reward"] == 1.0, printed
    recorded = turns(out)
    assert len(recorded) >= 2
    calls = [tool for turn in recorded for tool in turn["tools"]]
    assert calls and set(calls) == {SHELL_TOOL[name]}  # the CLI's own tool ran the fix
    if STACK == "classic":
        assert {turn["dialect"] for turn in recorded} == {cli.dialect}
    assert not sandbox_root.exists() or list(sandbox_root.iterdir()) == []


def test_a_missing_cli_is_one_line_saying_how_to_install_it(
    tmp_path: Path, sandbox_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_AGENT_CLIS", str(tmp_path / "no-clis"))
    out = tmp_path / "run"
    assert main(["demo", "--agent", "codex", "--output", str(out)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("rollout-gateway demo: error: --agent codex: codex (@openai/codex@")
    assert "python -m rollout_gateway.agent_clis install codex" in line
    assert not out.exists() and not sandbox_root.exists()
