"""The mixin against the reference gateway on loopback, with real OpenAI-SDK agents.

Scripted model <- reference gateway (with per-rollout keys and an admin token) <- agents
that are real ``openai.AsyncOpenAI`` clients running in fake sandboxes. What the env
state holds must equal what the agent exchanged, to the token.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import verifiers as vf
from helpers import FAST_POLL, GatewayTestEnv
from openai import AsyncOpenAI

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.scripted.tokenizer import encode_prompt
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.testing import FakeSandbox, FakeSandboxClient, task_row

SCRIPT = [
    {"tool": "run_shell", "arguments": {"command": "echo one"}},
    {"tool": "run_shell", "arguments": {"command": "echo two"}},
    {"say": "All done."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def make_agent(exchanges: dict[str, list[Any]]):
    async def agent(sandbox: FakeSandbox) -> int:
        env = sandbox.env_vars
        client = AsyncOpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"])
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"Fix it.\n<script>{json.dumps(SCRIPT)}</script>"}
        ]
        log = exchanges.setdefault(env["OPENAI_BASE_URL"].rsplit("/", 1)[-1], [])
        async with client:
            for _ in range(10):
                response = await client.chat.completions.create(
                    model=env["OPENAI_MODEL"], messages=messages, tools=TOOLS
                )
                message = response.choices[0].message
                log.append((list(messages), message))
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    command = json.loads(call.function.arguments)["command"]
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "content": command.upper()}
                    )
        sandbox.files["result.txt"] = "PASS"
        return 0

    return agent


async def test_mixin_against_the_reference_gateway_records_what_agents_exchanged():
    exchanges: dict[str, list[Any]] = {}
    async with running_server(create_scripted_model_app()) as model_root:
        config = GatewayConfig(
            upstreams=[f"{model_root}/v1"], require_rollout_keys=True, admin_token="adm"
        )
        async with running_server(create_app(config)) as gateway_root:
            env = GatewayTestEnv(
                sandbox_client=FakeSandboxClient(make_agent(exchanges)),
                gateway={
                    "tunnel_provider": "direct",
                    "admin_token": "adm",
                    "poll": FAST_POLL,
                    # In-process fake agents have no launch wrapper to report their exit;
                    # tests/test_exits.py covers the wrapper against this server.
                    "exit_reports": False,
                },
                sandbox_creations_per_minute=None,
            )
            client = vf.OpenAIChatCompletionsClient(
                AsyncOpenAI(base_url=f"{gateway_root}/v1", api_key="unused")
            )
            try:
                states = await asyncio.gather(
                    *(env.rollout(task_row(i % 2), client, "scripted", {}) for i in range(4))
                )
                for state in states:
                    await env.rubric.score_rollout(state)
            finally:
                await env._teardown()

    for state in states:
        assert state["error"] is None, state["error"]
        assert state["reward"] == 1.0
        log = exchanges[state["rollout_id"]]
        steps = state["trajectory"]
        assert len(steps) == len(log) == 3
        for step, (sent, received) in zip(steps, log, strict=True):
            # Prompt ids are the scripted tokenizer's encoding of exactly what was sent.
            assert step["tokens"]["prompt_ids"] == encode_prompt(sent)
            assert step["tokens"]["completion_mask"] == [1] * len(step["tokens"]["completion_ids"])
            assert len(step["tokens"]["completion_logprobs"]) == len(
                step["tokens"]["completion_ids"]
            )
            [assistant] = step["completion"]
            if received.tool_calls:
                assert assistant.tool_calls[0].name == "run_shell"
                assert (
                    assistant.tool_calls[0].arguments == received.tool_calls[0].function.arguments
                )
            else:
                assert assistant.content == received.content == "All done."
        # The completion rendered into the state is the agent's conversation after the prompt.
        roles = [m.role for m in state["completion"]]
        assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert state["completion"][1].content == "ECHO ONE"
