"""verifiers 0.3: an agent that sends no sampling parameters, on a real vLLM (issue 30).

The same agent (the OpenAI SDK with messages only) through ``CliAgentEnv``'s own
interception and through gateway mode, in front of the same real engine, nothing
registered: both complete, and the gateway's step says what the agent sent (nothing)
and what went upstream (no ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import verifiers as vf
from helpers import GatewayTestEnv
from openai import AsyncOpenAI

from rollout_gateway.polling import PollPolicy
from rollout_gateway.testing import FakeSandbox, FakeSandboxClient, task_row

from .conftest import ADMIN, RealGateway
from .test_sampling_defaults import roomy_prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def messages_only_agent(prompt: str) -> Any:
    async def agent(sandbox: FakeSandbox) -> int:
        env = sandbox.env_vars
        client = AsyncOpenAI(
            base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"], max_retries=0
        )
        async with client:
            await client.chat.completions.create(
                model=env["OPENAI_MODEL"], messages=[{"role": "user", "content": prompt}]
            )
        return 0

    return agent


async def run(real: RealGateway, prompt: str, *, use_gateway: bool) -> vf.State:
    root = str(real.control.base_url).rstrip("/") if use_gateway else real.engine_url[:-3]
    client = vf.OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url=f"{root}/v1", api_key="x", max_retries=0)
    )
    port = free_port()
    env = GatewayTestEnv(
        use_gateway=use_gateway,
        sandbox_client=FakeSandboxClient(messages_only_agent(prompt)),
        gateway={
            "tunnel_provider": "direct",
            "admin_token": ADMIN,
            "agent_timeout": 600,
            "poll": PollPolicy(min_interval=0.05, max_interval=0.2),
        },
        max_turns=5,
        interception_port=port,
        interception_url=f"http://127.0.0.1:{port}",
        poll_interval=0.05,
        timeout_seconds=600,
        sandbox_creations_per_minute=None,
    )
    try:
        return await asyncio.wait_for(env.rollout(task_row(0), client, real.model, {}), 600)
    finally:
        await env._teardown()


async def test_no_sampling_parameters_in_both_modes(real: RealGateway) -> None:
    prompt = await roomy_prompt(real, 32)
    own = await run(real, prompt, use_gateway=False)
    via_gateway = await run(real, prompt, use_gateway=True)
    for state in (own, via_gateway):
        assert state.get("error") is None, state.get("error")
        assert len(state["trajectory"]) == 1
    step = via_gateway["trajectory"][0]
    assert step["tokens"] and step["tokens"]["completion_ids"]
    assert step["extras"]["agent_sampling"] == {}  # what the agent sent
    assert "max_tokens" not in step["extras"]["sampling"]  # what went upstream
