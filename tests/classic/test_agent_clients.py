"""The agent's variables on the classic stack: each official client, built from the
sandbox's environment alone, reaches its own rollout's route with its own key."""

from __future__ import annotations

from typing import Any

import verifiers as vf
from agent_clients import CLIENT_VARS, sent_by_each_client

from rollout_gateway.testing import FakeSandboxClient, task_row


async def sandbox_env(env: Any, model_client: vf.Client, sandboxes: FakeSandboxClient) -> dict:
    await env.rollout(task_row(0), model_client, "policy-model", {})
    [sandbox] = sandboxes.sandboxes.values()
    return dict(sandbox.env_vars)


def bearer(headers: Any) -> str | None:
    value = headers.get("authorization") or ""
    return value.removeprefix("Bearer ") if value.startswith("Bearer ") else None


async def test_each_client_reaches_its_rollouts_route_with_the_rollouts_key(
    make_env, sandboxes, model_client, gateway
):
    env_vars = await sandbox_env(make_env(), model_client, sandboxes)
    rollout_id = gateway.unregistered[0]
    rollout = f"https://tunnel-1.example/v1/rollouts/{rollout_id}"
    key = env_vars["OPENAI_API_KEY"]
    assert env_vars["ANTHROPIC_BASE_URL"] == env_vars["OPENAI_BASE_URL"] == rollout
    assert env_vars["ANTHROPIC_API_KEY"] == key
    assert env_vars["ANTHROPIC_MODEL"] == env_vars["OPENAI_MODEL"] == "policy-model"

    chat, responses, messages = sent_by_each_client(env_vars)
    assert str(chat.url) == f"{rollout}/chat/completions"
    assert str(responses.url) == f"{rollout}/responses"
    # The Anthropic SDK (and Claude Code) append /v1/messages to the base URL.
    assert str(messages.url) == f"{rollout}/v1/messages"
    assert chat.headers["authorization"] == responses.headers["authorization"] == f"Bearer {key}"
    # Claude Code sends the key as x-api-key, the Anthropic SDK 2.x as a Bearer token.
    assert key in (messages.headers.get("x-api-key"), bearer(messages.headers))


async def test_the_env_cannot_point_a_client_elsewhere_and_the_host_leaks_nothing(
    make_env, sandboxes, model_client, monkeypatch
):
    host = {
        "ANTHROPIC_API_KEY": "sk-ant-host",
        "ANTHROPIC_BASE_URL": "https://api.anthropic.com",
        "ANTHROPIC_AUTH_TOKEN": "host-token",
        "OPENAI_API_KEY": "sk-host",
        "CLAUDE_CONFIG_DIR": "/root/.claude",
    }
    for name, value in host.items():
        monkeypatch.setenv(name, value)
    env = make_env(
        environment_vars={
            "ANTHROPIC_BASE_URL": "http://evil",
            "ANTHROPIC_API_KEY": "stolen",
            "ANTHROPIC_MODEL": "other",
            "TASK_MODE": "easy",
        }
    )
    env_vars = await sandbox_env(env, model_client, sandboxes)
    assert env_vars["ANTHROPIC_BASE_URL"].startswith("https://tunnel-1.example/v1/rollouts/")
    assert env_vars["ANTHROPIC_API_KEY"] == env_vars["OPENAI_API_KEY"] != "stolen"
    assert env_vars["ANTHROPIC_MODEL"] == "policy-model"
    assert env_vars["TASK_MODE"] == "easy"
    assert "ANTHROPIC_AUTH_TOKEN" not in env_vars and "CLAUDE_CONFIG_DIR" not in env_vars
    assert not set(host.values()) & set(env_vars.values())
    assert set(CLIENT_VARS) <= set(env_vars)
