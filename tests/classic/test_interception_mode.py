"""use_gateway = False: the env is plain CliAgentEnv (interception), no gateway resource."""

from __future__ import annotations

import httpx
import verifiers as vf
from helpers import GatewayTestEnv
from openai import AsyncOpenAI
from support.local_cluster import free_port

from rollout_gateway.testing import FakeGateway, FakeSandbox, FakeSandboxClient, task_row


def upstream_model() -> vf.Client:
    """A model endpoint answering every chat request with one fixed message."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "all fixed"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            },
        )

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return vf.OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url="http://model.test/v1", api_key="x", http_client=http)
    )


async def test_interception_mode_runs_cli_agent_env_unchanged(tunnels):
    gateway = FakeGateway()
    replies: list[str] = []

    async def agent(sandbox: FakeSandbox) -> int:
        # The agent talks to the env's interception server, as under plain CliAgentEnv.
        env_vars = sandbox.env_vars
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(
                env_vars["OPENAI_BASE_URL"] + "/chat/completions",
                headers={"Authorization": f"Bearer {env_vars['OPENAI_API_KEY']}"},
                json={"model": "m", "messages": [{"role": "user", "content": "fix it"}]},
            )
        replies.append(response.json()["choices"][0]["message"]["content"])
        sandbox.files["result.txt"] = "PASS"
        return 0

    port = free_port()
    env = GatewayTestEnv(
        use_gateway=False,
        sandbox_client=FakeSandboxClient(agent),
        gateway={"transport": gateway.transport(), "tunnel_provider": tunnels},
        interception_port=port,
        interception_url=f"http://127.0.0.1:{port}",
        poll_interval=0.05,
        sandbox_creations_per_minute=None,
    )
    try:
        state = await env.rollout(task_row(0), upstream_model(), "m", {})
        await env.rubric.score_rollout(state)
    finally:
        await env._teardown()

    assert replies == ["all fixed"]
    assert state["error"] is None
    assert len(state["trajectory"]) == 1
    assert "/rollout/" in state["interception_base_url"]  # CliAgentEnv's own routing
    assert state["reward"] == 1.0  # post_rollout ran through CliAgentEnv.destroy_sandbox
    assert gateway.calls == []
    assert tunnels.opened == []
