"""The pinned prime-sandboxes accepts the requests verifiers' CliAgentEnv builds.

verifiers 0.3.1 builds ``CreateSandboxRequest`` with a string ``start_command`` and a
``vm`` flag; prime-sandboxes 0.3.0 and later reject both (a pydantic ValidationError,
which is not a ``vf.Error``). A dependency bump that breaks this fails here, not in a
training run.
"""

from __future__ import annotations

from helpers import GatewayTestEnv, cli_agent_env_request
from prime_sandboxes import CreateSandboxRequest

from rollout_gateway.testing import FakeSandboxClient


async def test_the_gateway_path_builds_a_valid_request():
    env = GatewayTestEnv(
        sandbox_client=FakeSandboxClient(),
        docker_image="python:3.11-slim",
        labels=["rl"],
        environment_vars={"A": "1"},
    )
    state = {"rollout_id": "rollout_x", "model": "m", "rollout_base_url": "http://g/v1/rollouts/x"}
    env_vars = await env.build_env_vars(state)  # type: ignore[arg-type]
    request = await env.build_sandbox_request(state, env_vars)  # type: ignore[arg-type]
    assert isinstance(request, CreateSandboxRequest)
    assert request.start_command == "tail -f /dev/null"
    assert request.vm is False
    assert request.labels == ["rl"]
    assert request.environment_vars["A"] == "1"
    await env._teardown()


def test_cli_agent_env_request_shape_is_accepted():
    request = cli_agent_env_request()
    assert request.start_command == "tail -f /dev/null"
