"""Drop-in compatibility: an env written for verifiers 0.1.11's experimental mixin runs unchanged.

``EarlierStyleEnv`` is written the way such envs were: it switches gateway mode on in its
own ``__init__`` by calling ``init_gateway(gateway_port=..., timeout_seconds=None)`` and
overrides steps with the earlier signatures. Only the import changed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import verifiers as vf
from core_world import NO_WAIT_RETRY, no_wait
from helpers import FAST_POLL, task_dataset

from rollout_gateway import RolloutGatewayMixin
from rollout_gateway.testing import (
    FakeGateway,
    FakeSandbox,
    FakeSandboxClient,
    FakeTunnelProvider,
    rollout_id_of,
    task_row,
)


def calls_counter() -> Counter[str]:
    return Counter()


class EarlierStyleEnv(RolloutGatewayMixin, vf.CliAgentEnv):
    """Written for the earlier mixin: init_gateway in __init__, earlier-signature overrides."""

    def __init__(self, gateway_port: int = 8000, timeout_seconds: float | None = None, **kw: Any):
        super().__init__(
            run_command="python agent.py",
            dataset=task_dataset(),
            rubric=vf.Rubric(funcs=[]),
            **kw,
        )
        self.steps: Counter[str] = Counter()
        self.init_gateway(gateway_port=gateway_port, timeout_seconds=timeout_seconds)

    async def register_rollout(self, state: vf.State) -> None:
        self.steps["register_rollout"] += 1
        await super().register_rollout(state)

    async def unregister_rollout(self, state: vf.State) -> None:
        self.steps["unregister_rollout"] += 1
        await super().unregister_rollout(state)

    async def fetch_trajectory(self, state: vf.State) -> None:
        self.steps["fetch_trajectory"] += 1
        await super().fetch_trajectory(state)

    async def get_gateway_tunnel_url(self, local_addr: str | None = None) -> str:
        self.steps["get_gateway_tunnel_url"] += 1
        assert local_addr == "gateway.test"  # the earlier call shape: the gateway's host
        return await super().get_gateway_tunnel_url(local_addr=local_addr)

    async def build_env_vars(self, state: vf.State) -> dict[str, str]:
        self.steps["build_env_vars"] += 1
        return await super().build_env_vars(state)

    async def start_agent(self, state: vf.State) -> None:
        self.steps["start_agent"] += 1
        await super().start_agent(state)

    async def poll_job_completion(self, state: vf.State, sandbox_id: str, background_job: Any):
        self.steps["poll_job_completion"] += 1
        await super().poll_job_completion(state, sandbox_id, background_job)

    async def wait_for_agent_completion(self, state: vf.State) -> None:
        self.steps["wait_for_agent_completion"] += 1
        await super().wait_for_agent_completion(state)


def build(gateway: FakeGateway, sandboxes: FakeSandboxClient, tunnels: FakeTunnelProvider, **kw):
    return EarlierStyleEnv(
        sandbox_client=sandboxes,
        gateway={
            "transport": gateway.transport(),
            "tunnel_provider": tunnels,
            "retry": NO_WAIT_RETRY,
            "poll": FAST_POLL,
            "sleep": no_wait,
        },
        sandbox_creations_per_minute=None,
        max_retries=0,
        **kw,
    )


def one_turn(gateway: FakeGateway):
    async def agent(sandbox: FakeSandbox) -> int:
        gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        return 0

    return agent


async def test_init_gateway_with_timeout_none_means_no_agent_limit(gateway, tunnels, model_client):
    sandboxes = FakeSandboxClient(one_turn(gateway))
    env = build(gateway, sandboxes, tunnels, timeout_seconds=None)
    try:
        assert env.gateway_settings.agent_timeout is None
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None and state["agent_timed_out"] is False
    finally:
        await env._teardown()


async def test_init_gateway_without_timeout_seconds_takes_the_earlier_default():
    class NoTimeoutEnv(RolloutGatewayMixin, vf.CliAgentEnv):
        def __init__(self, **kw: Any) -> None:
            super().__init__(run_command="a", dataset=task_dataset(), **kw)
            self.init_gateway()  # no timeout_seconds at all

    env = NoTimeoutEnv(sandbox_client=FakeSandboxClient())
    try:
        assert env.gateway_settings.agent_timeout == 21600.0
    finally:
        await env._teardown()


async def test_calling_init_gateway_again_keeps_the_constructors_settings_and_seams(
    gateway, tunnels, model_client
):
    sandboxes = FakeSandboxClient(one_turn(gateway))
    env = build(gateway, sandboxes, tunnels, gateway_port=8123)
    try:
        # The seams given to the constructor survived init_gateway in EarlierStyleEnv.__init__.
        assert env.gateway_settings.transport is not None
        assert env.gateway_settings.tunnel_provider is tunnels
        assert env.gateway_settings.gateway_port == 8123
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None
        assert tunnels.opened == [("gateway.test", 8000)]  # the URL names its port
    finally:
        await env._teardown()


async def test_every_overridden_step_runs_once_per_rollout_with_earlier_signatures(
    gateway, tunnels, model_client
):
    sandboxes = FakeSandboxClient(one_turn(gateway))
    env = build(gateway, sandboxes, tunnels)
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None
        assert set(env.steps.values()) == {1}, env.steps
        assert len(env.steps) == 8
        assert gateway.op_counts["unregister"] == 1
        # The earlier state keys.
        for key in (
            "rollout_id",
            "gateway_url",
            "tunnel_local_addr",
            "tunnel_url",
            "tunnel_id",
            "rollout_base_url",
            "agent_start_time",
            "agent_completed",
            "agent_exit_code",
            "agent_stdout",
            "agent_stderr",
            "agent_timed_out",
            "trajectory",
            "prompt",
            "completion",
            "is_truncated",
            "stop_condition",
            "is_completed",
        ):
            state[key]  # present (State forwards input fields such as "prompt")
        assert state["tunnel_id"] == "tunnel-1"  # the provider's id, as the earlier mixin set
    finally:
        await env._teardown()


async def test_the_envs_own_client_timeouts_are_kept_the_route_is_not(
    gateway, tunnels, model_client
):
    """The earlier mixin set the agent's timeouts only where the env had not."""
    sandboxes = FakeSandboxClient(one_turn(gateway))
    own = {
        "OPENAI_TIMEOUT": "30",
        "OPENAI_REQUEST_TIMEOUT": "31",
        "HTTPX_TIMEOUT": "32",
        "OPENAI_BASE_URL": "http://elsewhere.test/v1",
        "OPENAI_API_KEY": "sk-env",
        "OPENAI_MODEL": "other-model",
    }
    env = build(gateway, sandboxes, tunnels, environment_vars=own)
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None
        env_vars = next(iter(sandboxes.sandboxes.values())).env_vars
        assert (env_vars["OPENAI_TIMEOUT"], env_vars["OPENAI_REQUEST_TIMEOUT"]) == ("30", "31")
        assert env_vars["HTTPX_TIMEOUT"] == "32"
        # Where the agent's calls go, and as whom, stay the gateway's.
        assert env_vars["OPENAI_BASE_URL"] == state["rollout_base_url"]
        assert env_vars["OPENAI_API_KEY"] != "sk-env"
        assert env_vars["OPENAI_MODEL"] == "m"
    finally:
        await env._teardown()


async def test_without_the_envs_own_timeouts_they_follow_the_agent_timeout(
    gateway, tunnels, model_client
):
    sandboxes = FakeSandboxClient(one_turn(gateway))
    env = build(gateway, sandboxes, tunnels, timeout_seconds=120)
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None
        env_vars = next(iter(sandboxes.sandboxes.values())).env_vars
        timeouts = {k: env_vars[k] for k in ("OPENAI_TIMEOUT", "OPENAI_REQUEST_TIMEOUT")}
        assert timeouts == {"OPENAI_TIMEOUT": "120", "OPENAI_REQUEST_TIMEOUT": "120"}
        assert env_vars["HTTPX_TIMEOUT"] == "120"
    finally:
        await env._teardown()


async def test_a_failed_rollout_still_runs_each_step_at_most_once(gateway, tunnels, model_client):
    sandboxes = FakeSandboxClient(one_turn(gateway))
    gateway.fail("trajectory", 400)
    env = build(gateway, sandboxes, tunnels)
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert isinstance(state["error"], vf.InfraError)
        assert max(env.steps.values()) == 1, env.steps
        assert env.steps["unregister_rollout"] == 1
        assert gateway.active == [] and sandboxes.alive == []
    finally:
        await env._teardown()


async def test_a_direct_call_with_earlier_arguments_works(gateway, tunnels, model_client):
    """An env method calling get_gateway_tunnel_url(local_addr=...) itself, mid-rollout."""
    sandboxes = FakeSandboxClient(one_turn(gateway))
    seen: list[str] = []

    class CallsTunnelItself(EarlierStyleEnv):
        async def build_env_vars(self, state: vf.State) -> dict[str, str]:
            seen.append(await self.get_gateway_tunnel_url(local_addr="gateway.test"))
            return await super().build_env_vars(state)

    env = CallsTunnelItself(
        sandbox_client=sandboxes,
        gateway={"transport": gateway.transport(), "tunnel_provider": tunnels, "sleep": no_wait},
        sandbox_creations_per_minute=None,
    )
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None
        assert seen == [state["tunnel_url"]]
        assert len(tunnels.opened) == 1
    finally:
        await env._teardown()


async def test_a_synchronous_start_agent_override_completes(gateway, tunnels, model_client):
    """start_agent runs the agent to its end itself: no background job to wait for."""
    sandboxes = FakeSandboxClient()

    class SyncAgentEnv(EarlierStyleEnv):
        async def start_agent(self, state: vf.State) -> None:
            result = await self.sandbox_client.execute_command(state["sandbox_id"], "run-agent")
            gateway.add_turn(state["rollout_id"], [{"role": "user", "content": "x"}], [])
            state["agent_exit_code"] = result.exit_code

    env = SyncAgentEnv(
        sandbox_client=sandboxes,
        gateway={"transport": gateway.transport(), "tunnel_provider": tunnels, "sleep": no_wait},
        sandbox_creations_per_minute=None,
    )
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None, state["error"]
        assert state["agent_completed"] is True
        assert len(state["trajectory"]) == 1
        assert gateway.cancelled == []  # the agent exited on its own: nothing to cancel
        assert gateway.active == [] and sandboxes.alive == []
    finally:
        await env._teardown()


async def test_use_gateway_defaults_to_true_as_in_the_earlier_mixin():
    assert EarlierStyleEnv.use_gateway is True


async def test_a_timed_out_agent_is_stopped_before_post_rollout(gateway, tunnels, model_client):
    stopped_at: list[float] = []
    scored_at: list[float] = []

    async def looping(sandbox: FakeSandbox) -> int:
        gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        await asyncio.Event().wait()
        return 0

    sandboxes = FakeSandboxClient(looping)

    def on_command(sandbox: FakeSandbox, command: str) -> Any:
        if ".rollout-gateway-agent.pid" in command:  # the stop script
            assert sandbox.agent_task is not None
            sandbox.agent_task.cancel()
            stopped_at.append(time.monotonic())
        return None

    sandboxes.on_command = on_command

    class Scoring(EarlierStyleEnv):
        async def post_rollout(self, state: vf.State) -> None:
            sandbox = sandboxes.sandboxes[state["sandbox_id"]]
            assert sandbox.agent_task is not None and sandbox.agent_task.done()
            scored_at.append(time.monotonic())

    env = Scoring(
        timeout_seconds=0.05,
        sandbox_client=sandboxes,
        gateway={"transport": gateway.transport(), "tunnel_provider": tunnels, "sleep": no_wait},
        sandbox_creations_per_minute=None,
    )
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["agent_timed_out"] is True and state["error"] is None
        assert state["stop_condition"] == "agent_timeout"
        assert stopped_at and scored_at and stopped_at[0] <= scored_at[0]
        assert state["agent_exit_code"] == 137  # the stopped job's own exit
        assert gateway.cancelled == [state["rollout_id"]]
        assert len(state["trajectory"]) == 1  # what was recorded is kept
    finally:
        await env._teardown()
