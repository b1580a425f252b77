"""The same agent through CliAgentEnv's own interception and through the gateway.

Each test runs one agent (a real OpenAI-SDK client in a fake sandbox) twice on the same
task and limits: ``use_gateway=False`` (verifiers 0.3.1's ``CliAgentEnv`` intercepts every
call in the env process) and ``use_gateway=True`` (the reference gateway on loopback in
front of the same scripted model). What the trainer reads must agree: the stop
condition, ``is_truncated``, the error type, the turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import verifiers as vf
from helpers import GatewayTestEnv
from openai import AsyncOpenAI
from support.local_cluster import free_port

from rollout_gateway.polling import PollPolicy
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.testing import FakeSandbox, FakeSandboxClient, task_row

ADMIN = "side-by-side-admin-token"
SCRIPT = [{"tool": "run_shell", "arguments": {"command": f"echo {i}"}} for i in range(6)] + [
    {"say": "done"}
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


@dataclass
class AgentLog:
    """What the agent saw: each answer, each error, when it last ran."""

    answers: int = 0
    errors: list[tuple[float, str]] = field(default_factory=list)
    stopped_at: float | None = None


def retrying_agent(log: AgentLog):
    """A tool-calling agent that retries every error, forever (as agent frameworks retry
    a 4xx they map to a generic API error): only its sandbox's stop ends it."""

    async def agent(sandbox: FakeSandbox) -> int:
        env = sandbox.env_vars
        client = AsyncOpenAI(
            base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"], max_retries=0
        )
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"Fix it.\n<script>{json.dumps(SCRIPT)}</script>"}
        ]
        try:
            async with client:
                while True:
                    try:
                        response = await client.chat.completions.create(
                            model=env["OPENAI_MODEL"], messages=messages, tools=TOOLS
                        )
                    except Exception as e:  # noqa: BLE001 - retried whatever it is
                        log.errors.append((time.monotonic(), type(e).__name__))
                        await asyncio.sleep(0.02)
                        continue
                    log.answers += 1
                    message = response.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    for call in message.tool_calls or []:
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
                    if not message.tool_calls:
                        messages.append({"role": "user", "content": "again"})
        finally:
            log.stopped_at = time.monotonic()

    return agent


@contextlib.asynccontextmanager
async def servers() -> AsyncIterator[tuple[str, str]]:
    """The scripted model and the reference gateway in front of it, on loopback."""
    async with running_server(create_scripted_model_app()) as model_root:
        config = GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=ADMIN)
        async with running_server(create_app(config)) as gateway_root:
            yield model_root, gateway_root


async def run_once(*, use_gateway: bool, max_turns: int, log: AgentLog) -> vf.State:
    async with servers() as (model_root, gateway_root):
        root = gateway_root if use_gateway else model_root
        client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=f"{root}/v1", api_key="x", max_retries=0)
        )
        port = free_port()
        env = GatewayTestEnv(
            use_gateway=use_gateway,
            sandbox_client=FakeSandboxClient(retrying_agent(log)),
            gateway={
                "tunnel_provider": "direct",
                "admin_token": ADMIN,
                "agent_timeout": 60,
                "poll": PollPolicy(min_interval=0.01, max_interval=0.05),
            },
            max_turns=max_turns,
            interception_port=port,
            interception_url=f"http://127.0.0.1:{port}",
            poll_interval=0.05,
            timeout_seconds=60,
            sandbox_creations_per_minute=None,
        )
        try:
            return await asyncio.wait_for(env.rollout(task_row(0), client, "scripted", {}), 60)
        finally:
            await env._teardown()


@pytest.mark.parametrize("use_gateway", [False, True], ids=["interception", "gateway"])
async def test_max_turns_is_max_turns_reached_and_the_retrying_agent_is_stopped(
    use_gateway: bool,
) -> None:
    log = AgentLog()
    state = await run_once(use_gateway=use_gateway, max_turns=2, log=log)

    # What verifiers' own CliAgentEnv reports for this task and limit (verifiers 0.3.1):
    assert state["error"] is None
    assert state["stop_condition"] == "max_turns_reached"
    assert state["is_truncated"] is False  # 0.3 counts the turn limit as no truncation
    assert len(state["trajectory"]) == 2 and log.answers == 2
    assert log.stopped_at is not None  # the agent, retrying forever, was ended
    if use_gateway:
        # The gateway refused turn 3; the agent retried it; the env stopped the agent
        # within a second of the first refusal (exit channel), not at a timeout.
        first_refusal = log.errors[0][0]
        assert log.errors[0][1] == "PermissionDeniedError"  # 403 turn_refused
        assert log.stopped_at - first_refusal < 1.0, log.stopped_at - first_refusal
        assert state["agent_timed_out"] is False


def sdk_agent(log: AgentLog):
    """An agent on the OpenAI SDK's defaults (two retries of a 5xx / connection error),
    which exits 1 when a call still fails, as most agents do."""

    async def agent(sandbox: FakeSandbox) -> int:
        env = sandbox.env_vars
        client = AsyncOpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"])
        try:
            async with client:
                await client.chat.completions.create(
                    model=env["OPENAI_MODEL"], messages=[{"role": "user", "content": "hi"}]
                )
        except Exception as e:  # noqa: BLE001
            log.errors.append((time.monotonic(), type(e).__name__))
            raise RuntimeError(f"model call failed: {e}") from e  # the job exits 1
        return 0

    return agent


async def test_an_engine_outage_is_the_engines_error_not_an_agent_crash() -> None:
    # The engine is down: interception mode's CliAgentEnv records verifiers' ModelError;
    # gateway mode must not call it the agent's crash (AgentError), but the same family.
    dead = f"http://127.0.0.1:{free_port()}"
    states = {}
    for use_gateway in (False, True):
        log = AgentLog()
        async with running_server(
            create_app(GatewayConfig(upstreams=[f"{dead}/v1"], admin_token=ADMIN))
        ) as gateway_root:
            root = gateway_root if use_gateway else dead
            client = vf.OpenAIChatCompletionsClient(
                AsyncOpenAI(base_url=f"{root}/v1", api_key="x", max_retries=0)
            )
            port = free_port()
            env = GatewayTestEnv(
                use_gateway=use_gateway,
                sandbox_client=FakeSandboxClient(sdk_agent(log)),
                gateway={"tunnel_provider": "direct", "admin_token": ADMIN, "agent_timeout": 60},
                interception_port=port,
                interception_url=f"http://127.0.0.1:{port}",
                poll_interval=0.05,
                timeout_seconds=60,
                sandbox_creations_per_minute=None,
            )
            try:
                states[use_gateway] = await asyncio.wait_for(
                    env.rollout(task_row(0), client, "scripted", {}), 60
                )
            finally:
                await env._teardown()
    for use_gateway, state in states.items():
        error = state["error"]
        assert isinstance(error, vf.ModelError), (use_gateway, repr(error))
        assert state["stop_condition"] == "has_error"
        assert state["trajectory"] == []
    gateway_error = states[True]["error"]
    assert type(gateway_error).__name__ == "EngineError"
    assert isinstance(gateway_error, vf.InfraError)  # rescheduled, not trained on
    assert "connect 502" in str(gateway_error) or "upstream unreachable" in str(gateway_error)
