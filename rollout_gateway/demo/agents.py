"""``rollout-gateway demo --agent``: which agent runs in each sandbox.

``example`` (the default) is the example env's own agent (``agent.py``, the OpenAI SDK,
chat completions). ``claude-code`` and ``codex`` are the real CLIs
(:mod:`rollout_gateway.agent_clis`, installed with npm once per machine), run on the same
tasks: the sandbox sees the CLI's install read-only, the command reads the task from
``task.md``, and the scripted model's ``run_shell`` steps drive the CLI's own shell tool
(``Bash``, ``exec_command``). The CLI reaches its rollout through the variables every
agent gets (``ANTHROPIC_*`` for Claude Code's Messages, ``OPENAI_*`` for Codex's
Responses).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollout_gateway.agent_clis import AGENT_CLIS, AgentCli
from rollout_gateway.demo.options import DemoError

#: The example env's own agent.
EXAMPLE_AGENT = "example"
#: How the CLI is given the task: the task file the example env writes.
TASK_PROMPT = '"$(cat task.md)"'


@dataclass(frozen=True)
class DemoAgent:
    """A real CLI as the demo runs it: its program and what the sandbox must see."""

    cli: AgentCli
    program: Path

    @property
    def read_only(self) -> list[str]:
        """Host directories each sandbox sees read-only: the CLI's install."""
        return [str(self.cli.install_dir())]

    def command(self) -> str:
        """The shell command that runs the CLI on the task, in the task's directory."""
        return self.cli.command(str(self.program), TASK_PROMPT)

    def describe(self) -> str:
        """One line for the demo's header."""
        return f"{self.cli.name} {self.cli.version} ({self.program})"


def demo_agent(name: str) -> DemoAgent | None:
    """The CLI ``--agent`` names (``None``: the example agent); ``DemoError`` in one line,
    saying how to install it, when it is not installed."""
    if name == EXAMPLE_AGENT:
        return None
    cli = AGENT_CLIS[name]
    program = cli.executable()
    if program is None:
        raise DemoError(f"--agent {name}: {cli.install_hint()}")
    return DemoAgent(cli, program)


__all__ = ["EXAMPLE_AGENT", "DemoAgent", "demo_agent"]
