"""verifiers v1: an agent that sends no sampling parameters, on a real vLLM (issue 30).

The same agent program (the OpenAI SDK with messages only, as mini-swe-agent's litellm
sends them) through v1's own interception and through gateway mode, in front of the same
real engine, with no ``max_tokens`` anywhere: both complete, and the trace's
``calls[].sampling`` is what v1's own interception records (nothing the gateway added).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarnessConfig
from v1.test_side_by_side import first_task, program_harness
from verifiers.v1.interception import InterceptionServer

from rollout_gateway.v1 import gateway_synced_agent

from .conftest import RealGateway
from .test_sampling_defaults import roomy_prompt

_AGENT = """
import os, pathlib, openai
client = openai.OpenAI(max_retries=0)
prompt = pathlib.Path(os.environ["PROMPT_FILE"]).read_text()
client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                               messages=[{"role": "user", "content": prompt}])
"""


def prompt_harness(prompt_file: Path, tmp_path: Path) -> type[Any]:
    """The messages-only agent, told where its prompt is."""
    base = program_harness(_AGENT, tmp_path / "log")

    class PromptHarness(base):  # type: ignore[misc, valid-type]
        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):  # type: ignore[override]
            from fix_bug_v1.harness import run_program

            await runtime.write("agent.py", _AGENT.encode())
            env = {
                "OPENAI_BASE_URL": endpoint,
                "OPENAI_API_KEY": secret,
                "OPENAI_MODEL": ctx.model,
                "PROMPT_FILE": str(prompt_file),
            }
            return await run_program(runtime, [sys.executable, "agent.py"], env)

    return PromptHarness


def agent_config(real: RealGateway, base_url: str) -> vf.AgentConfig:
    return vf.AgentConfig(
        model=real.model,
        client=vf.EvalClientConfig(base_url=base_url),
        harness=FixBugHarnessConfig(),
        runtime=vf.SubprocessConfig(),
    )


async def run_own(real: RealGateway, harness: type[Any]) -> vf.Trace:
    async with InterceptionServer(requires_tunnel=False) as server:
        agent = vf.Agent(agent_config(real, real.engine_url), interception=server)
        agent.harness = harness(agent.harness.config)
        async with agent:
            return await agent.run(first_task())


async def run_through_gateway(real: RealGateway, harness: type[Any]) -> vf.Trace:
    root = str(real.control.base_url).rstrip("/")
    async with contextlib.AsyncExitStack() as stack:
        interception = await stack.enter_async_context(_interception(root))
        agent = vf.Agent(agent_config(real, f"{root}/v1"), interception=interception)
        agent.harness = harness(agent.harness.config)
        gateway_synced_agent(agent, interception)
        async with agent:
            return await agent.run(first_task())


@contextlib.asynccontextmanager
async def _interception(root: str) -> Any:
    from rollout_gateway.v1 import GatewayInterception, GatewayInterceptionConfig

    from .conftest import ADMIN

    interception = GatewayInterception(
        GatewayInterceptionConfig(tunnel="direct", url=root), admin_token=ADMIN
    )
    async with interception:
        yield interception


async def test_no_sampling_parameters_as_with_v1s_own_interception(
    real: RealGateway, tmp_path: Path
) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(await roomy_prompt(real, 32))
    harness = prompt_harness(prompt_file, tmp_path)
    own = await run_own(real, harness)
    via_gateway = await run_through_gateway(real, harness)
    for trace in (own, via_gateway):
        assert trace.ok, trace.errors
        assert trace.num_turns == 1 and [c.error for c in trace.calls] == [None]
    # What was asked, as v1 records it: nobody set max_tokens.
    assert via_gateway.calls[0].sampling == own.calls[0].sampling
    assert via_gateway.calls[0].sampling.max_tokens is None
    upstream = via_gateway.info["rollout_gateway"]["upstream_sampling"]
    assert upstream[0]["call"] == 0 and "max_tokens" not in upstream[0]["sampling"]
    assert via_gateway.branches[0].token_ids  # token-exact: the sampled tokens are there
