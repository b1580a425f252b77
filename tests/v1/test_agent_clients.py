"""The agent's variables on the v1 stack: the example harness gives its program the
OpenAI and the Anthropic clients' variables from v1's endpoint and key, so each official
client reaches the rollout's keyed route, and its command alone picks the agent."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

import pytest
import verifiers.v1 as vf
from agent_clients import CLIENT_VARS, sent_by_each_client
from fix_bug_v1 import FixBugHarness, FixBugHarnessConfig, FixBugTaskset

from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import (
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
    agent_environment,
    gateway_synced_agent,
)

from .conftest import SANDBOX_ROOT, Stack

#: The agent's command: print its whole environment as JSON.
DUMP_ENV = shlex.join(
    [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
)


class KeptOutput(FixBugHarness):
    """The example harness, keeping its program's output."""

    outputs: list[str] = []

    async def launch(self, *args: Any, **kwargs: Any) -> Any:
        result = await super().launch(*args, **kwargs)
        KeptOutput.outputs.append(result.stdout)
        return result


def test_the_anthropic_base_url_is_the_endpoint_without_its_v1():
    env = agent_environment("http://gw:8000/v1", "key", "m")
    assert env["ANTHROPIC_BASE_URL"] == "http://gw:8000"
    assert env["OPENAI_BASE_URL"] == "http://gw:8000/v1"
    assert env["ANTHROPIC_API_KEY"] == env["OPENAI_API_KEY"] == "key"
    assert agent_environment("http://gw/v1/", "k", "m")["ANTHROPIC_BASE_URL"] == "http://gw"


async def run_command(stack: Stack, make_interception: Any, runtime: Any, **harness: Any) -> str:
    interception, _ = await make_interception()
    config = LocalSandboxAgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=f"{stack.gateway_url}/v1"),
        harness=FixBugHarnessConfig(**harness),
        runtime=runtime,
    )
    KeptOutput.outputs = []
    agent = vf.Agent(config, interception=interception)
    agent.harness = KeptOutput(agent.harness.config)
    gateway_synced_agent(agent, interception)
    task = next(iter(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1"))))
    async with agent:
        await agent.run(task)
    (output,) = KeptOutput.outputs
    return output


@pytest.mark.parametrize("runtime_kind", ["subprocess", "local_sandbox"])
async def test_each_client_reaches_the_rollout_and_the_host_leaks_nothing(
    stack: Stack, make_interception: Any, monkeypatch: pytest.MonkeyPatch, runtime_kind: str
) -> None:
    if runtime_kind == "local_sandbox":
        reason = unavailable_reasons()[IsolationMode.BWRAP]
        if reason is not None:
            pytest.skip(f"bwrap unavailable here: {reason}")
        runtime: Any = LocalSandboxRuntimeConfig(isolation="bwrap", root=SANDBOX_ROOT)
    else:
        runtime = vf.SubprocessConfig()
    host = {
        "ANTHROPIC_API_KEY": "sk-ant-host",
        "ANTHROPIC_BASE_URL": "https://api.anthropic.com",
        "ANTHROPIC_AUTH_TOKEN": "host-token-31337",
        "CLAUDE_CONFIG_DIR": "/root/.claude-host",
    }
    for name, value in host.items():
        monkeypatch.setenv(name, value)
    env_vars = json.loads(
        await run_command(
            stack,
            make_interception,
            runtime,
            command=DUMP_ENV,
            env={"ANTHROPIC_BASE_URL": "http://evil", "TASK_MODE": "easy"},
        )
    )
    assert set(CLIENT_VARS) <= set(env_vars)
    assert env_vars["TASK_MODE"] == "easy"  # the env author's own variable
    assert env_vars["ANTHROPIC_API_KEY"] != host["ANTHROPIC_API_KEY"]
    assert env_vars["ANTHROPIC_BASE_URL"] == stack.gateway_url  # not the env's, nor the host's
    if runtime_kind == "local_sandbox":
        # v1's own subprocess runtime passes the host's environment (less *API_KEY*
        # names); a contained sandbox passes nothing of it.
        assert not set(host.values()) & set(env_vars.values())
        assert "ANTHROPIC_AUTH_TOKEN" not in env_vars and "CLAUDE_CONFIG_DIR" not in env_vars
    key = env_vars["OPENAI_API_KEY"]
    assert env_vars["ANTHROPIC_API_KEY"] == key
    assert env_vars["ANTHROPIC_MODEL"] == env_vars["OPENAI_MODEL"] == "scripted"

    chat, responses, messages = sent_by_each_client(env_vars)
    root = stack.gateway_url
    # v1's endpoint is the gateway's keyed root: the routes are chosen by the key.
    assert str(chat.url) == f"{root}/v1/chat/completions"
    assert str(responses.url) == f"{root}/v1/responses"
    assert str(messages.url) == f"{root}/v1/messages"
    assert chat.headers["authorization"] == f"Bearer {key}"
    assert key in (messages.headers.get("x-api-key"), messages.headers.get("authorization", "")[7:])
