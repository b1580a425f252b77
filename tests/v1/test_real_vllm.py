"""Opt-in: v1 gateway mode against a real vLLM (``tools/real-vllm``), one branch per rollout.

Set ``ROLLOUT_GATEWAY_REAL_VLLM`` to the vLLM's OpenAI base URL (e.g.
``http://127.0.0.1:8001/v1``) and ``ROLLOUT_GATEWAY_REAL_VLLM_MODEL`` (default
``gemma3-270m``); skipped otherwise (CI has no vLLM).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarnessConfig

from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.v1 import GatewayInterception, GatewayInterceptionConfig, gateway_synced_agent

from .conftest import ADMIN_TOKEN, SpyTransport, script_harness
from .test_end_to_end import expected_branch, first_task

VLLM = os.environ.get("ROLLOUT_GATEWAY_REAL_VLLM")
MODEL = os.environ.get("ROLLOUT_GATEWAY_REAL_VLLM_MODEL", "gemma3-270m")

pytestmark = pytest.mark.skipif(not VLLM, reason="set ROLLOUT_GATEWAY_REAL_VLLM to a vLLM URL")

_CHAT_AGENT = """
import os, openai
client = openai.OpenAI()
messages = [{"role": "user", "content": "Name a colour."}]
for _ in range(3):
    answer = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "Another one."}]
"""


ChatHarness = script_harness("chat.py", _CHAT_AGENT)


async def test_three_turns_on_real_vllm_are_one_branch_equal_to_the_record() -> None:
    assert VLLM is not None
    spy = SpyTransport()
    async with contextlib.AsyncExitStack() as exits:
        exits.push_async_callback(spy.aclose)
        app = create_app(GatewayConfig(upstreams=[VLLM.rstrip("/")], admin_token=ADMIN_TOKEN))
        gateway = await exits.enter_async_context(running_server(app))
        interception = await exits.enter_async_context(
            GatewayInterception(
                GatewayInterceptionConfig(tunnel="direct"), transport=spy, admin_token=ADMIN_TOKEN
            )
        )
        config = vf.AgentConfig(
            model=MODEL,
            client=vf.EvalClientConfig(base_url=f"{gateway}/v1"),
            harness=FixBugHarnessConfig(),
            runtime=vf.SubprocessConfig(),
            sampling=vf.SamplingConfig(temperature=0.0, max_tokens=12),
        )
        agent = vf.Agent(config, interception=interception)
        agent.harness = ChatHarness(agent.harness.config)
        gateway_synced_agent(agent, interception)
        async with agent:
            trace = await agent.run(first_task())
    assert trace.ok, trace.errors
    assert trace.num_turns == 3 and trace.num_branches == 1
    ids, mask, logprobs = expected_branch(spy.trajectories[-1]["trajectory"])
    branch = trace.branches[0]
    assert list(branch.token_ids) == ids and list(branch.sampled_mask) == mask
    sampled = [lp for lp, m in zip(branch.logprobs, branch.sampled_mask, strict=True) if m]
    assert sampled == pytest.approx(logprobs)
