"""The real Claude Code and Codex CLIs through the gateway, in front of the scripted model:
the model's scripted calls drive each CLI's own shell tool (``Bash``, ``exec_command``),
the tool runs, the CLI finishes, and every turn is recorded token-exact in the CLI's
dialect. The CLIs come from npm (``python -m rollout_gateway.agent_clis install``; CI
installs them and sets ``ROLLOUT_GATEWAY_REQUIRE_AGENT_CLIS=1``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_gateway.agent_clis import CLAUDE_CODE, CODEX, AgentCli
from rollout_gateway.scripted import tokenizer as tok
from rollout_gateway.scripted.faults import completion_digest

from .support import CliRun, gateway, network_tracer, program_of, remote_addresses

#: One shell call (the example tasks' ``run_shell`` step: the model calls the CLI's own
#: shell tool with it), then a final answer.
PROMPT = (
    '<script>[{"tool": "run_shell", "arguments": {"command": '
    '"printf hello > out.txt && cat out.txt"}}, {"say": "Wrote it."}]</script> '
    "Write hello to out.txt."
)
#: The tool each CLI's call goes to.
SHELL_TOOL = {"claude-code": "Bash", "codex": "exec_command"}


def assert_token_exact(run: CliRun, cli: AgentCli) -> None:
    """Every served completion is a recorded turn, ids and all, in the CLI's dialect."""
    steps = run.trajectory["trajectory"]
    assert run.trajectory["num_turns"] == len(steps) == len(run.served) == 2, run.stderr[-3000:]
    for step, served in zip(steps, run.served, strict=True):
        tokens = step["tokens"]
        assert step["extras"]["dialect"] == cli.dialect
        # The engine tokenized exactly the recorded prompt, and answered the recorded ids.
        assert tokens["prompt_ids"] == tok.encode_prompt(step["prompt"])
        assert completion_digest(tokens["completion_ids"]) == served["completion"]
        assert len(tokens["completion_logprobs"]) == len(tokens["completion_ids"])
    [call] = steps[0]["completion"][0]["tool_calls"]
    assert call["function"]["name"] == SHELL_TOOL[cli.name]
    command = json.loads(call["function"]["arguments"])
    assert "printf hello > out.txt" in next(iter(command.values()))
    # The tool's result reached the model in the next turn's prompt.
    assert any(m.get("role") == "tool" and "hello" in json.dumps(m) for m in steps[1]["prompt"])
    assert steps[1]["completion"][0]["content"] == "Wrote it."


@pytest.mark.parametrize("cli", [CLAUDE_CODE, CODEX], ids=lambda c: c.name)
async def test_the_cli_runs_its_own_tool_and_the_trajectory_is_token_exact(
    cli: AgentCli, tmp_path: Path
) -> None:
    program = program_of(cli)
    trace = tmp_path / "connections.trace"
    tracer = network_tracer(trace)
    async with gateway(tmp_path) as gw:
        run = await gw.run_cli(cli, program, PROMPT, tmp_path, wrap=tracer)
    detail = f"exit {run.returncode}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-3000:]}"
    assert run.returncode == 0, detail
    assert (run.work / "out.txt").read_text() == "hello", detail  # the CLI's tool ran
    assert "Wrote it." in run.stdout, detail
    assert_token_exact(run, cli)
    if not tracer:
        pytest.skip("trajectory checked; the loopback-only check needs strace (ptrace)")
    # Nothing but the gateway on loopback: no telemetry, update check or plugin sync.
    assert remote_addresses(trace) <= {"127.0.0.1", "::1"}, remote_addresses(trace)
