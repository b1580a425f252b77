"""An offline harness: the example agent script, run with the env's own interpreter.

v1's built-in ``bash``/``null`` harnesses install their dependencies with ``uv`` at setup,
which needs a package index. This one writes ``agent.py`` (standard library + ``openai``)
into the runtime and runs it with ``sys.executable``, so on the subprocess runtime it needs
nothing beyond the env's own environment.
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.clients import ModelContext
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData

from rollout_gateway.v1.agent_env import agent_environment


class FixBugHarnessConfig(vf.HarnessConfig):
    """The agent's knobs."""

    id: str = "rollout-gateway-fix-bug-v1"
    max_agent_turns: int = 10
    """The agent's own cap on model calls (``AGENT_MAX_TURNS``); v1's limits still apply."""
    command_timeout: int = 60
    """Seconds per shell command."""
    command: str | None = None
    """A shell command to run instead of ``agent.py`` (in the task's directory, with
    ``task.md`` there): another agent on the same variables, e.g. Claude Code with
    ``claude -p "$(cat task.md)" --permission-mode bypassPermissions`` (it reads
    ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` / ``ANTHROPIC_MODEL``)."""


class FixBugHarness(vf.Harness[FixBugHarnessConfig]):
    """Runs ``agent.py`` against the rollout's endpoint in the rollout's runtime."""

    NEEDS_CONTAINER = False
    SUPPORTS_RESUME = False

    async def launch(
        self,
        ctx: ModelContext,
        trace: vf.Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        **kwargs: Any,
    ) -> ProgramResult:
        """Write the agent and its task into the runtime, run it to its exit."""
        _, prompt = self.resolve_text_prompt(data)
        # One agent script for both stacks: the classic example's, shipped in the package
        # (its package imports verifiers 0.3 only lazily, so this works on 0.4).
        agent = resources.files("rollout_gateway.examples.fix_bug_env").joinpath("agent.py")
        source = agent.read_bytes()
        await runtime.write("agent.py", source)
        await runtime.write("task.md", (prompt or "").encode())
        env = {
            **self.config.env,
            # The OpenAI and Anthropic clients' variables: a command of another agent
            # (Claude Code) reaches the rollout as agent.py does.
            **agent_environment(endpoint, secret, ctx.model),
            "AGENT_MAX_TURNS": str(self.config.max_agent_turns),
            "AGENT_COMMAND_TIMEOUT": str(self.config.command_timeout),
        }
        if self.config.command is not None:
            return await run_program(runtime, ["/bin/sh", "-c", self.config.command], env)
        return await run_program(runtime, [sys.executable, "agent.py"], env)


async def run_program(runtime: Runtime, argv: list[str], env: dict[str, str]) -> ProgramResult:
    """Run the harness's main program: ``Runtime.run_program`` (verifiers 0.4.0), which
    later 0.4 builds fold into ``Runtime.run``."""
    runner = getattr(runtime, "run_program", None) or runtime.run
    return await runner(argv, env)
