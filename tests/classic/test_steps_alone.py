"""Every overridable step works when called on its own, outside ``rollout()``.

The earlier mixin's own tests (and envs that drive the steps themselves) call a step
directly on a state they built: ``poll_job_completion(state, sandbox_id, job)`` on a state
holding a ``rollout_id`` and a ``tunnel_local_addr``, expecting ``vf.TunnelError`` when
that host's tunnel dies. Each step here acts on the state it is given
(rollout_gateway.classic.rollouts).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import verifiers as vf
from core_world import no_wait
from helpers import FAST_POLL, FAST_RETRY, GatewayTestEnv

from rollout_gateway import RolloutGatewayMixin
from rollout_gateway.errors import GatewayTunnelError
from rollout_gateway.lifecycle import PLACEHOLDER_API_KEY
from rollout_gateway.testing import FakeGateway, FakeSandbox, FakeSandboxClient, FakeTunnelProvider

DOCS = Path(__file__).resolve().parents[2] / "docs" / "classic.md"
GATEWAY_URL = "http://gateway.test:8000"

#: Every overridable step (a method an env may override and call), each tested below.
STEPS = {
    "register_rollout",
    "unregister_rollout",
    "cancel_rollout",
    "fetch_trajectory",
    "build_env_vars",
    "build_sandbox_request",
    "start_agent",
    "poll_job_completion",
    "wait_for_agent_completion",
    "stop_agent",
    "delete_rollout_sandbox",
    "get_gateway_tunnel_url",
    "gateway_sampling_params",
    "resolve_gateway_url",
}


async def runs_until_stopped(sandbox: FakeSandbox) -> int:
    await asyncio.Event().wait()
    return 0


async def exits_at_once(sandbox: FakeSandbox) -> int:
    return 3


def build(
    gateway: FakeGateway,
    sandboxes: FakeSandboxClient,
    tunnels: FakeTunnelProvider,
    **settings: Any,
) -> GatewayTestEnv:
    return GatewayTestEnv(
        sandbox_client=sandboxes,
        gateway={
            "transport": gateway.transport(),
            "tunnel_provider": tunnels,
            "retry": FAST_RETRY,
            "poll": FAST_POLL,
            "sleep": no_wait,
            **settings,
        },
        sandbox_creations_per_minute=None,
        max_retries=0,
    )


def hand_built_state(**fields: Any) -> vf.State:
    """A state as a test or an env's own driver builds it (no rollout() behind it)."""
    return vf.State(
        rollout_id="rollout_alone",
        gateway_url=GATEWAY_URL,
        model="m",
        sampling_args={"temperature": 0.5},
        rollout_base_url="https://tunnel.example/v1/rollouts/rollout_alone",
        **fields,
    )


@pytest.fixture
async def env_on(tunnels: FakeTunnelProvider):
    envs: list[GatewayTestEnv] = []

    def make(gateway: FakeGateway, sandboxes: FakeSandboxClient, **settings: Any):
        env = build(gateway, sandboxes, tunnels, **settings)
        envs.append(env)
        return env

    yield make
    for env in envs:
        await env._teardown()


async def started_agent(env: GatewayTestEnv, state: vf.State) -> None:
    """Create the state's sandbox and start its agent, by the steps alone."""
    request = await env.build_sandbox_request(state, await env.build_env_vars(state))
    await env.create_sandbox(state, request)
    await env.start_agent(state)


def test_every_overridable_step_is_tested_alone_and_documented() -> None:
    own = {
        name
        for name, value in vars(RolloutGatewayMixin).items()
        if callable(value) and not name.startswith("_")
    }
    own |= {"build_env_vars", "build_sandbox_request", "start_agent", "poll_job_completion"}
    own |= {"wait_for_agent_completion", "stop_agent", "delete_rollout_sandbox"}
    not_steps = {"init_gateway", "gateway_resources", "rollout", "render_completion"}
    not_steps |= {"teardown_gateway", "agent_timeout", "destroy_sandbox", "teardown_sandboxes"}
    assert own - not_steps == STEPS
    documented = set(re.findall(r"`(\w+)\(", DOCS.read_text()))
    assert STEPS <= documented, sorted(STEPS - documented)


async def test_register_then_unregister_alone_keeps_the_rollouts_key_between(env_on) -> None:
    gateway = FakeGateway(issue_api_keys=True)
    env = env_on(gateway, FakeSandboxClient())
    state = hand_built_state()
    await env.register_rollout(state)
    registered = gateway.rollouts["rollout_alone"]
    assert registered.register_body["model"] == "m"
    assert registered.register_body["sampling_params"]["temperature"] == 0.5
    # The key the gateway issued is the agent's, as inside a rollout.
    env_vars = await env.build_env_vars(state)
    assert env_vars["OPENAI_API_KEY"] == registered.api_key
    await env.unregister_rollout(state)
    assert gateway.unregistered == ["rollout_alone"]
    # Let go once unregistered: nothing of it is kept.
    assert (await env.build_env_vars(state))["OPENAI_API_KEY"] == PLACEHOLDER_API_KEY


async def test_unregister_and_cancel_alone_reach_a_rollout_registered_elsewhere(env_on) -> None:
    gateway = FakeGateway()
    other = env_on(gateway, FakeSandboxClient())
    await other.register_rollout(hand_built_state())
    env = env_on(gateway, FakeSandboxClient())
    await env.cancel_rollout(hand_built_state())
    assert gateway.cancelled == ["rollout_alone"]
    await env.unregister_rollout(hand_built_state())
    assert gateway.unregistered == ["rollout_alone"]


async def test_fetch_trajectory_alone_writes_the_state(env_on) -> None:
    gateway = FakeGateway()
    env = env_on(gateway, FakeSandboxClient())
    state = hand_built_state()
    await env.register_rollout(state)
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    gateway.add_turn("rollout_alone", [user], [answer])
    await env.fetch_trajectory(state)
    assert len(state["trajectory"]) == 1
    assert state["gateway_num_turns"] == 1


async def test_env_vars_and_sandbox_request_alone(env_on) -> None:
    env = env_on(FakeGateway(), FakeSandboxClient())
    state = hand_built_state()
    env_vars = await env.build_env_vars(state)
    assert env_vars["OPENAI_BASE_URL"] == state["rollout_base_url"]
    assert env_vars["OPENAI_MODEL"] == "m"
    request = await env.build_sandbox_request(state, env_vars)
    assert request.name == "rollout_alone" and request.environment_vars == env_vars


async def test_start_poll_and_wait_alone_run_the_agent_to_its_exit(env_on) -> None:
    sandboxes = FakeSandboxClient(exits_at_once)
    env = env_on(FakeGateway(), sandboxes)
    state = hand_built_state()
    await started_agent(env, state)
    assert state["background_job"] is not None
    await env.poll_job_completion(state, state["sandbox_id"], state["background_job"])
    assert state["agent_exit_code"] == 3 and state["agent_polls"] >= 1
    again = hand_built_state()
    await started_agent(env, again)
    await env.wait_for_agent_completion(again)
    assert again["agent_completed"] is True and again["agent_exit_code"] == 3
    assert again["agent_timed_out"] is False


async def test_wait_alone_times_the_agent_out(env_on) -> None:
    env = env_on(FakeGateway(), FakeSandboxClient(runs_until_stopped), agent_timeout=0.2)
    env.gateway_settings = env.gateway_settings.replace(sleep=asyncio.sleep)
    state = hand_built_state()
    await started_agent(env, state)
    await env.wait_for_agent_completion(state)
    assert state["agent_timed_out"] is True and state["agent_completed"] is True


async def test_poll_alone_raises_tunnel_error_when_the_hosts_tunnel_dies(
    env_on, tunnels: FakeTunnelProvider
) -> None:
    # The earlier mixin's own test: a tunnel started for a host, a state naming that host,
    # an agent that never exits; the tunnel dies while the step polls.
    sandboxes = FakeSandboxClient(runs_until_stopped)
    env = env_on(FakeGateway(), sandboxes, tunnel_liveness_interval=0.01, sleep=asyncio.sleep)
    url = await env.get_gateway_tunnel_url(local_addr="10.0.0.1")
    state = vf.State(rollout_id="rollout_test123", tunnel_local_addr="10.0.0.1")
    sandbox_state = hand_built_state()
    await started_agent(env, sandbox_state)

    async def kill_tunnel() -> None:
        await asyncio.sleep(0.05)
        tunnels.handles[0].alive = False

    killer = asyncio.ensure_future(kill_tunnel())
    with pytest.raises(vf.TunnelError) as raised:
        await asyncio.wait_for(
            env.poll_job_completion(
                state, sandbox_state["sandbox_id"], sandbox_state["background_job"]
            ),
            10,
        )
    await killer
    assert isinstance(raised.value, GatewayTunnelError)
    assert url in str(raised.value)  # the host's own tunnel (the pool then replaces it)


async def test_stop_agent_alone_stops_it_and_keeps_its_exit(env_on) -> None:
    sandboxes = FakeSandboxClient(runs_until_stopped)
    env = env_on(FakeGateway(), sandboxes, sleep=asyncio.sleep)
    state = hand_built_state()
    await started_agent(env, state)
    await env.stop_agent(state)
    assert state["agent_exit_code"] == 137


async def test_delete_rollout_sandbox_alone_deletes_it(env_on) -> None:
    sandboxes = FakeSandboxClient(exits_at_once)
    env = env_on(FakeGateway(), sandboxes)
    state = hand_built_state()
    await started_agent(env, state)
    await env.delete_rollout_sandbox(state)
    assert sandboxes.alive == []


async def test_get_gateway_tunnel_url_alone(env_on, tunnels: FakeTunnelProvider) -> None:
    env = env_on(FakeGateway(), FakeSandboxClient())
    url = await env.get_gateway_tunnel_url(local_addr="10.0.0.1")
    assert await env.get_gateway_tunnel_url() == url
    assert tunnels.opened == [("10.0.0.1", 8000)]


async def test_sampling_params_and_gateway_url_alone(env_on, model_client) -> None:
    env = env_on(FakeGateway(), FakeSandboxClient())
    state = hand_built_state(client=model_client)
    state["sampling_args"] = {"temperature": 0.5, "n": 4}
    assert env.gateway_sampling_params(state) == {"temperature": 0.5}
    assert env.resolve_gateway_url(state) == GATEWAY_URL


async def test_a_state_without_a_rollout_id_says_what_is_missing(env_on) -> None:
    env = env_on(FakeGateway(), FakeSandboxClient())
    with pytest.raises(Exception, match="no rollout_id"):
        await env.unregister_rollout(vf.State(gateway_url=GATEWAY_URL))
