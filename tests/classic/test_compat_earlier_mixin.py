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

import pytest
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
        # The earlier call shape: the gateway's host (or none, outside a rollout).
        assert local_addr in ("gateway.test", None)
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


# ------------------------------------------------ more of the earlier mixin's contract


class SetupCallsTunnel(EarlierStyleEnv):
    """Written the earlier way: the env asks for the gateway's tunnel in its own setup
    (outside any rollout), then without ``local_addr`` once one is open."""

    async def setup_gateway_tunnel(self) -> tuple[str, str]:
        first = await self.get_gateway_tunnel_url(local_addr="gateway.test")
        again = await self.get_gateway_tunnel_url()
        return first, again


async def test_get_gateway_tunnel_url_outside_a_rollout_gives_the_hosts_shared_tunnel(
    gateway, tunnels, model_client
):
    env = SetupCallsTunnel(
        sandbox_client=FakeSandboxClient(one_turn(gateway)),
        gateway={"transport": gateway.transport(), "tunnel_provider": tunnels, "sleep": no_wait},
        sandbox_creations_per_minute=None,
    )
    try:
        first, again = await env.setup_gateway_tunnel()
        assert first == again == "https://tunnel-1.example"
        assert tunnels.opened == [("gateway.test", 8000)]  # local_addr on gateway_port
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None
        assert state["tunnel_url"] == first and len(tunnels.opened) == 1  # shared, not a new one
        # After the rollout, as in an env's own teardown step: the same tunnel.
        assert await env.get_gateway_tunnel_url() == first
    finally:
        await env._teardown()


async def test_get_gateway_tunnel_url_without_local_addr_and_no_tunnel_says_so(gateway, tunnels):
    env = build(gateway, FakeSandboxClient(), tunnels)
    try:
        with pytest.raises(ValueError, match="local_addr is required"):
            await env.get_gateway_tunnel_url()
    finally:
        await env._teardown()


async def test_init_gateway_sets_the_earlier_public_attributes(gateway, tunnels):
    env = build(gateway, FakeSandboxClient(), tunnels, gateway_port=8123, timeout_seconds=600)
    try:
        assert env.gateway_port == 8123
        assert env.gateway_timeout_seconds == 600
        assert env._gateway_timeout_seconds == 600  # the earlier mixin's own name of it
        env.gateway_port = 9000  # an env may still set them before its rollouts
        env.gateway_timeout_seconds = None
        assert env.gateway_settings.gateway_port == 9000
        assert env.gateway_settings.agent_timeout is None
    finally:
        await env._teardown()


async def test_unregister_is_not_called_for_a_rollout_whose_register_failed(
    gateway, tunnels, model_client
):
    sandboxes = FakeSandboxClient(one_turn(gateway))
    gateway.fail("register", 400)
    env = build(gateway, sandboxes, tunnels)
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert isinstance(state["error"], vf.InfraError)
        assert env.steps["register_rollout"] == 1
        assert env.steps["unregister_rollout"] == 0  # as the earlier mixin: never registered
        assert gateway.op_counts["unregister"] == 0 and gateway.op_counts["cancel"] == 0
        assert sandboxes.alive == []
    finally:
        await env._teardown()


class OwnStartAgent(EarlierStyleEnv):
    """Written the earlier way: starts the agent's command itself, without the launch
    wrapper (so no exit report can come)."""

    async def start_agent(self, state: vf.State) -> None:
        self.steps["start_agent"] += 1
        state["background_job"] = await self.sandbox_client.start_background_job(
            state["sandbox_id"], self.run_command
        )
        state["agent_start_time"] = time.time()
        state["agent_completed"] = False


def quick_agent(gateway: FakeGateway):
    async def agent(sandbox: FakeSandbox) -> int:
        gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        await asyncio.sleep(0.05)
        return 0

    return agent


class RecordedSleep:
    """The settings' sleep, real, recording every wait asked for."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await asyncio.sleep(seconds)


async def test_quick_rollouts_of_an_own_start_agent_are_not_held_to_the_safety_poll(
    gateway, tunnels, model_client
):
    sleep = RecordedSleep()
    sandboxes = FakeSandboxClient(quick_agent(gateway))
    gateway.watch(sandboxes)
    env = OwnStartAgent(
        sandbox_client=sandboxes,
        gateway={"transport": gateway.transport(), "tunnel_provider": tunnels, "sleep": sleep},
        sandbox_creations_per_minute=None,
        max_retries=0,
    )
    try:
        started = time.monotonic()
        for i in range(20):
            state = await env.rollout(task_row(i), model_client, "m", {})
            assert state["error"] is None and state["agent_exit_code"] == 0
        took = time.monotonic() - started
        # The env knows it did not use the wrapper: it polls adaptively (PollPolicy's
        # default 10 s safety interval is never waited on), so 20 quick rollouts take
        # about 20 x 0.1 s, not 20 x 10 s.
        assert max(sleep.asked) < env.gateway_settings.poll.safety_interval
        assert took < 10.0, took
    finally:
        await env._teardown()


async def test_an_image_without_an_http_client_is_polled_adaptively(gateway, tunnels, model_client):
    sleep = RecordedSleep()
    sandboxes = FakeSandboxClient(quick_agent(gateway))
    sandboxes.http_client = False  # no curl, wget nor python3: the wrapper says nothing
    gateway.watch(sandboxes)
    env = build(gateway, sandboxes, tunnels)
    env.init_gateway(sleep=sleep, poll={})  # the default PollPolicy
    try:
        started = time.monotonic()
        state = await env.rollout(task_row(0), model_client, "m", {})
        took = time.monotonic() - started
        assert state["error"] is None and state["agent_exit_code"] == 0
        policy = env.gateway_settings.poll
        # No start report within start_grace: polled adaptively, never the safety wait.
        assert max(sleep.asked) < policy.safety_interval
        assert took < policy.start_grace + 2.0, took
    finally:
        await env._teardown()


async def test_with_the_wrappers_reports_the_sandbox_is_asked_only_to_confirm(
    gateway, tunnels, model_client
):
    sandboxes = FakeSandboxClient(quick_agent(gateway))
    gateway.watch(sandboxes)
    env = build(gateway, sandboxes, tunnels)
    env.init_gateway(sleep=RecordedSleep(), poll={})
    try:
        state = await env.rollout(task_row(0), model_client, "m", {})
        assert state["error"] is None
        assert sandboxes.calls["get_background_job"] == 1  # the exit report, confirmed once
    finally:
        await env._teardown()
