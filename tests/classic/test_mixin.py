"""RolloutGatewayMixin: the gateway-mode lifecycle end to end on the fakes."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

import httpx
import pytest
import verifiers as vf
from helpers import GATEWAY_BASE_URL, tokens, two_turn_agent
from openai import AsyncOpenAI
from verifiers.envs.experimental.cli_agent_env import AgentError

from rollout_gateway import (
    AgentCrashError,
    AgentPollError,
    AgentStartError,
    EmptyTrajectoryError,
    GatewayConfigError,
    GatewayRequestError,
    GatewayTunnelError,
    GatewayUnavailableError,
    PostRolloutError,
)
from rollout_gateway.lifecycle import PLACEHOLDER_API_KEY
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.testing import (
    FakeGateway,
    FakeSandbox,
    FakeSandboxClient,
    FakeTunnelProvider,
    rollout_id_of,
    task_row,
)


def client_for(base_url: str) -> vf.Client:
    return vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key="x"))


async def run(env: Any, model_client: vf.Client, example_id: int = 0) -> vf.State:
    return await env.rollout(task_row(example_id), model_client, "policy-model", {})


def assert_nothing_left(gateway: FakeGateway, sandboxes: FakeSandboxClient) -> None:
    assert gateway.active == [], f"left registered: {gateway.active}"
    assert sandboxes.alive == [], f"left alive: {sandboxes.alive}"


# ---------------------------------------------------------------- happy path


async def test_happy_path_registers_runs_fetches_scores_and_cleans_up(
    make_env, gateway, sandboxes, tunnels, model_client
):
    env = make_env(max_turns=12, max_seq_len=4096)
    env.sampling_args = {"n": 1, "extra_body": {"top_k": 20}, "temperature": 0.1}
    output = await env.run_rollout(
        task_row(0), model_client, "policy-model", {"temperature": 0.7, "max_tokens": 256}
    )

    rollout_id = gateway.unregistered[0]
    assert gateway.op_counts - Counter(exits=99) == Counter(register=1, trajectory=1, unregister=1)
    assert gateway.calls[0] == ("POST", f"/v1/rollouts/{rollout_id}/register")

    sandbox = next(iter(sandboxes.sandboxes.values()))
    request = sandbox.request
    assert request.name == rollout_id
    assert request.docker_image == env.docker_image
    assert request.start_command == env.start_command
    assert sandbox.env_vars["OPENAI_BASE_URL"] == (
        f"https://tunnel-1.example/v1/rollouts/{rollout_id}"
    )
    assert sandbox.env_vars["OPENAI_MODEL"] == "policy-model"
    assert sandbox.env_vars["OPENAI_API_KEY"] == PLACEHOLDER_API_KEY
    assert sandboxes.calls["delete"] == 1
    assert env.post_rollout_calls == 1

    assert output["reward"] == 1.0
    assert output["error"] is None
    assert output["stop_condition"] == "agent_completed"
    assert output["is_completed"] is True
    assert output["metrics"]["num_turns"] == 2.0
    assert output["token_usage"]["input_tokens"] == 9.0
    assert output["token_usage"]["output_tokens"] == 3.0
    assert_nothing_left(gateway, sandboxes)


async def test_register_payload_carries_model_sampling_params_and_limits(
    make_env, gateway, model_client
):
    captured: list[dict[str, Any]] = []
    original = gateway.handle

    async def recording(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/register"):
            import json

            captured.append(json.loads(request.content))
        return await original(request)

    env = make_env(
        max_turns=12,
        max_seq_len=4096,
        gateway={"transport": httpx.MockTransport(recording)},
    )
    env.sampling_args = {"n": 1, "extra_body": {"top_k": 20}, "temperature": 0.1}
    await env.rollout(task_row(0), model_client, "policy-model", {"temperature": 0.7})
    proposed_key = captured[0].pop("api_key")
    assert proposed_key.startswith("rk_") and len(proposed_key) >= 43
    assert captured == [
        {
            "model": "policy-model",
            "sampling_params": {"temperature": 0.7, "top_k": 20},
            "max_turns": 12,
            "max_seq_len": 4096,
        }
    ]


async def test_state_carries_lifecycle_keys_and_token_trajectory(
    make_env, gateway, sandboxes, model_client
):
    env = make_env()
    state = await run(env, model_client)
    rollout_id = state["rollout_id"]
    assert rollout_id.startswith("rollout_") and len(rollout_id) == len("rollout_") + 32
    assert state["gateway_url"] == "http://gateway.test:8000"
    assert state["tunnel_url"] == "https://tunnel-1.example"
    assert state["rollout_base_url"] == f"https://tunnel-1.example/v1/rollouts/{rollout_id}"
    assert state["agent_exit_code"] == 0
    assert state["agent_stdout"] == "ok"
    assert state["agent_stderr"] == ""
    assert state["agent_timed_out"] is False
    steps = state["trajectory"]
    assert [s["tokens"]["completion_ids"] for s in steps] == [[4, 5], [7]]
    assert [s["tokens"]["prompt_mask"] for s in steps] == [[0, 0, 0], [0] * 6]
    assert steps[1]["tokens"]["completion_logprobs"] == [-0.5]
    assert steps[0]["response"].message.tool_calls[0].name == "run_shell"
    assert [m.role for m in state["completion"]] == ["assistant", "tool", "assistant"]
    assert state["timing"].setup.end >= state["timing"].setup.start > 0


async def test_run_group_scores_and_serializes(make_env, gateway, sandboxes, model_client):
    env = make_env()
    outputs = await env.run_group(
        [task_row(0), task_row(1)],
        model_client,
        "policy-model",
        {},
        state_columns=["trajectory"],
    )
    assert [o["reward"] for o in outputs] == [1.0, 1.0]
    for output in outputs:
        assert output["trajectory"][0]["tokens"]["prompt_ids"] == [1, 2, 3]
    assert len(set(gateway.unregistered)) == 2
    assert_nothing_left(gateway, sandboxes)


async def test_per_rollout_api_key_reaches_the_agent(sandboxes, tunnels, model_client):
    gateway = FakeGateway(issue_api_keys=True)
    seen: list[tuple[str, str | None]] = []

    async def agent(sandbox: FakeSandbox) -> int:
        issued = gateway.rollouts[rollout_id_of(sandbox)].api_key
        seen.append((sandbox.env_vars["OPENAI_API_KEY"], issued))
        gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "hi"}], [])
        return 0

    sandboxes.agent = agent
    gateway.watch(sandboxes)
    from helpers import FAST_POLL, FAST_RETRY, GatewayTestEnv

    env = GatewayTestEnv(
        sandbox_client=sandboxes,
        gateway=GatewaySettings(
            tunnel_provider=tunnels,
            transport=gateway.transport(),
            retry=FAST_RETRY,
            poll=FAST_POLL,
        ),
    )
    try:
        state = await run(env, model_client)
    finally:
        await env._teardown()
    assert state["error"] is None
    [(given, issued)] = seen
    assert issued is not None and given == issued


async def test_no_host_secret_reaches_the_sandbox(make_env, sandboxes, model_client, monkeypatch):
    monkeypatch.setenv("HOST_SECRET_TOKEN", "s3cr3t")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-host-key")
    env = make_env(environment_vars={"TASK_MODE": "easy", "OPENAI_BASE_URL": "http://evil"})
    await run(env, model_client)
    env_vars = next(iter(sandboxes.sandboxes.values())).env_vars
    assert "HOST_SECRET_TOKEN" not in env_vars
    assert "s3cr3t" not in env_vars.values()
    assert env_vars["OPENAI_API_KEY"] != "sk-host-key"
    assert env_vars["TASK_MODE"] == "easy"  # the env author's own variable is kept
    assert env_vars["OPENAI_BASE_URL"].startswith("https://tunnel-1.example/")
    assert os.environ["HOST_SECRET_TOKEN"] == "s3cr3t"


# ---------------------------------------------------------------- tunnels


async def test_one_tunnel_per_host_across_many_concurrent_rollouts(
    make_env, gateway, sandboxes, tunnels, model_client
):
    tunnels.start_latency = 0.05
    env = make_env()
    states = await asyncio.gather(*(run(env, model_client, i) for i in range(20)))
    assert all(s["error"] is None for s in states)
    assert tunnels.opened == [("gateway.test", 8000)]
    assert {s["tunnel_url"] for s in states} == {"https://tunnel-1.example"}
    assert_nothing_left(gateway, sandboxes)


async def test_two_hosts_start_two_tunnels_concurrently(make_env, gateway, sandboxes, tunnels):
    tunnels.start_latency = 0.1
    env = make_env()
    a, b = client_for("http://gw-a.test:8000/v1"), client_for("http://gw-b.test:9000/v1")
    states = await asyncio.gather(*(run(env, c) for c in (a, b, a, b)))
    assert all(s["error"] is None for s in states)
    assert sorted(tunnels.opened) == [("gw-a.test", 8000), ("gw-b.test", 9000)]
    assert tunnels.max_in_flight == 2  # neither host waited for the other's start


async def test_dead_tunnel_is_replaced(make_env, gateway, sandboxes, tunnels, model_client):
    env = make_env()
    first = await run(env, model_client)
    tunnels.handles[0].alive = False
    second = await run(env, model_client)
    assert first["tunnel_url"] == "https://tunnel-1.example"
    assert second["tunnel_url"] == "https://tunnel-2.example"
    assert tunnels.handles[0].stops == 1


async def test_teardown_stops_every_tunnel_once_and_is_idempotent(
    make_env, gateway, sandboxes, tunnels
):
    env = make_env()
    for base in ("http://gw-a.test:8000/v1", "http://gw-b.test:8000/v1"):
        await run(env, client_for(base))
    resources = env.gateway_resources()
    await env._teardown()
    await env._teardown()
    assert [h.stops for h in tunnels.handles] == [1, 1]
    assert resources.closed


class _ClosingCounter(httpx.AsyncBaseTransport):
    """The fake gateway's transport, counting the clients closed over it (an
    ``httpx.AsyncClient`` closes its transport when it is closed)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.closed = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        self.closed += 1


async def test_a_rollout_after_teardown_runs_and_closes_what_it_opened(
    make_env, gateway, sandboxes, tunnels, model_client
):
    """Issue 34's leak: a rollout started after ``teardown_gateway()`` re-created a
    control-plane client (and a tunnel) that nothing closed."""
    counter = _ClosingCounter(gateway.transport())
    env = make_env(gateway={"transport": counter})
    first = await run(env, model_client)
    await env._teardown()
    assert counter.closed == 1 and [h.stops for h in tunnels.handles] == [1]
    # Two at once after the teardown: they share one fresh client and tunnel, closed
    # when the second ends.
    later = await asyncio.gather(run(env, model_client, 1), run(env, model_client, 2))
    assert [s["error"] for s in (first, *later)] == [None, None, None]
    assert counter.closed == 2
    assert [h.stops for h in tunnels.handles] == [1, 1]
    assert_nothing_left(gateway, sandboxes)
    # An env's own setup asking for a tunnel with no rollout running: refused, typed.
    with pytest.raises(GatewayUnavailableError, match="torn down"):
        await env.get_gateway_tunnel_url()


async def test_gateway_port_applies_when_the_url_names_none(make_env, gateway, sandboxes, tunnels):
    env = make_env(gateway={"gateway_port": 8123})
    await run(env, client_for("http://gw.test/v1"))
    assert tunnels.opened == [("gw.test", 8123)]


# ---------------------------------------------------------------- configuration


async def test_teardown_without_gateway_init_is_safe(sandboxes, tunnels):
    from helpers import GatewayTestEnv

    env = GatewayTestEnv(use_gateway=False, sandbox_client=sandboxes)
    await env._teardown()
    await env._teardown()


async def test_gateway_switched_on_after_construction_runs(
    gateway, sandboxes, tunnels, model_client
):
    """Nothing needs initialising: settings exist from construction, resources start lazily."""
    from helpers import FAST_POLL, GatewayTestEnv

    env = GatewayTestEnv(
        use_gateway=False,
        sandbox_client=sandboxes,
        gateway={"tunnel_provider": tunnels, "transport": gateway.transport(), "poll": FAST_POLL},
    )
    env.use_gateway = True
    state = await run(env, model_client)
    assert state["error"] is None
    assert gateway.unregistered == [state["rollout_id"]]
    assert sandboxes.alive == []
    await env._teardown()


async def test_client_without_base_url_raises_a_config_error(make_env, gateway, sandboxes):
    # A configuration error is raised, not recorded as one failed rollout among many:
    # no retry of the rollout can fix it.
    no_url = vf.OpenAIChatCompletionsClient(object())  # type: ignore[arg-type]
    env = make_env()
    with pytest.raises(GatewayConfigError, match="gateway_url"):
        await env.rollout(task_row(0), no_url, "m", {})
    assert_nothing_left(gateway, sandboxes)


def test_bad_settings_fail_at_construction(sandboxes):
    from helpers import GatewayTestEnv

    with pytest.raises(GatewayConfigError):
        GatewayTestEnv(sandbox_client=sandboxes, gateway={"tunnel_provider": "ssh"})
    with pytest.raises(GatewayConfigError):
        GatewayTestEnv(sandbox_client=sandboxes, sandbox_backend="docker")
    with pytest.raises(GatewayConfigError):
        GatewayTestEnv(sandbox_client=sandboxes, gateway={"agent_timeout": -1})


async def test_explicit_gateway_url_overrides_the_client(make_env, gateway, sandboxes, tunnels):
    env = make_env(gateway={"gateway_url": "http://other.test:7000/v1/"})
    state = await run(env, client_for(GATEWAY_BASE_URL))
    assert state["gateway_url"] == "http://other.test:7000"
    assert tunnels.opened == [("other.test", 7000)]


# ---------------------------------------------------------------- agent outcomes


async def test_empty_trajectory_is_an_infra_error_by_default(
    make_env, gateway, sandboxes, model_client
):
    async def silent(sandbox: FakeSandbox) -> int:
        return 0

    sandboxes.agent = silent
    state = await run(make_env(), model_client)
    assert isinstance(state["error"], EmptyTrajectoryError)
    assert isinstance(state["error"], vf.InfraError)
    assert state["stop_condition"] == "has_error"
    assert_nothing_left(gateway, sandboxes)


async def test_empty_trajectory_allowed_by_setting(make_env, gateway, sandboxes, model_client):
    async def silent(sandbox: FakeSandbox) -> int:
        return 0

    sandboxes.agent = silent
    state = await run(make_env(gateway={"allow_empty_trajectory": True}), model_client)
    assert state["error"] is None
    assert state["trajectory"] == []
    assert state["stop_condition"] == "agent_completed"


async def test_agent_crash_is_a_typed_error_but_keeps_the_trajectory(
    make_env, gateway, sandboxes, model_client
):
    async def crashing(sandbox: FakeSandbox) -> int:
        gateway.add_turn(
            rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [], tokens=tokens([1], [2])
        )
        raise RuntimeError("segfault")

    sandboxes.agent = crashing
    state = await run(make_env(), model_client)
    # verifiers 0.3's own AgentError (an InfraError) and the core's AgentCrashError.
    assert isinstance(state["error"], AgentError) and isinstance(state["error"], vf.InfraError)
    assert isinstance(state["error"], AgentCrashError)
    assert "after 1 turn(s)" in str(state["error"]) and "segfault" in str(state["error"])
    assert f"rollout_id={state['rollout_id']}" in str(state["error"])  # verifiers' context
    assert len(state["trajectory"]) == 1
    assert_nothing_left(gateway, sandboxes)


async def test_agent_timeout_stops_cancels_and_keeps_partial_trajectory(
    make_env, gateway, sandboxes, model_client
):
    async def slow(sandbox: FakeSandbox) -> int:
        gateway.add_turn(
            rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [], tokens=tokens([1], [2])
        )
        await asyncio.sleep(30)
        return 0

    sandboxes.agent = slow
    state = await run(make_env(gateway={"agent_timeout": 0.2}), model_client)
    assert state["agent_timed_out"] is True
    assert state["stop_condition"] == "agent_timeout"
    assert state["error"] is None
    assert len(state["trajectory"]) == 1
    assert gateway.cancelled == [state["rollout_id"]]
    assert_nothing_left(gateway, sandboxes)


async def test_completion_is_detected_quickly_without_busy_polling(
    make_env, gateway, sandboxes, model_client
):
    """Without exit reports: the default PollPolicy on a fake clock polls a few times and
    notices the exit within the 50 ms floor."""
    from rollout_gateway.polling import PollPolicy

    class FakeTime:
        now = 0.0

        def clock(self) -> float:
            return self.now

        async def sleep(self, seconds: float) -> None:
            if seconds >= 7.0:  # the tunnel monitor's interval: it must not move the clock
                await asyncio.Event().wait()
            self.now += seconds
            await asyncio.sleep(0)

    fake = FakeTime()
    exited_at: list[float] = []

    async def agent(sandbox: FakeSandbox) -> int:
        gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        while fake.now < 0.5:  # 0.5 s of (fake) work
            await asyncio.sleep(0)
        exited_at.append(fake.now)
        return 0

    sandboxes.agent = agent
    env = make_env(
        gateway={
            "poll": PollPolicy(),
            "clock": fake.clock,
            "sleep": fake.sleep,
            "tunnel_liveness_interval": 7.0,
            "exit_reports": False,
        }
    )
    state = await run(env, model_client)
    assert state["error"] is None
    assert state["agent_polls"] <= 15  # 50 ms floor over 0.5 s, not a busy loop
    assert fake.now - exited_at[0] <= 0.05 + 1e-9  # noticed within one floor interval


async def test_an_exit_report_is_confirmed_with_one_status_call(
    make_env, gateway, sandboxes, model_client
):
    """With exit reports the sandbox is asked once, to confirm the agent's report."""
    agent_may_exit = asyncio.Event()

    async def agent(sandbox: FakeSandbox) -> int:
        gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        await agent_may_exit.wait()
        return 0

    sandboxes.agent = agent
    env = make_env(gateway={"sleep": asyncio.sleep})  # real waits: 10 s safety interval
    task = asyncio.ensure_future(run(env, model_client))
    while sandboxes.calls["start_background_job"] == 0:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.2)  # running: only the first check at 50 ms, then nothing
    agent_may_exit.set()
    state = await asyncio.wait_for(task, 5)
    assert state["error"] is None
    assert sandboxes.calls["get_background_job"] == 1
    assert state["agent_polls"] == 1


async def test_an_unconfirmed_exit_report_does_not_end_the_rollout(
    make_env, gateway, sandboxes, model_client
):
    """The agent holds the key: a false report costs one status call, nothing more."""
    agent_may_exit = asyncio.Event()

    async def lying_agent(sandbox: FakeSandbox) -> int:
        gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        gateway.report_exit(rollout_id_of(sandbox), 0)  # "I exited" while still running
        await agent_may_exit.wait()
        sandbox.files["result.txt"] = "PASS"
        return 0

    sandboxes.agent = lying_agent
    sandboxes.on_agent_exit = None
    env = make_env()
    task = asyncio.ensure_future(run(env, model_client))
    while sandboxes.calls["get_background_job"] < 3:  # back on the poll policy
        await asyncio.sleep(0.001)
    assert not task.done()
    agent_may_exit.set()
    state = await asyncio.wait_for(task, 5)
    assert state["error"] is None and state["tests_passed"] is True


async def test_a_gateway_without_exit_reports_falls_back_to_polling(
    sandboxes, tunnels, model_client
):
    gateway = FakeGateway(exit_reports=False)
    from helpers import FAST_POLL, GatewayTestEnv

    sandboxes.agent = two_turn_agent(gateway)
    env = GatewayTestEnv(
        sandbox_client=sandboxes,
        gateway={"transport": gateway.transport(), "tunnel_provider": tunnels, "poll": FAST_POLL},
    )
    try:
        state = await run(env, model_client)
    finally:
        await env._teardown()
    assert state["error"] is None and state["tests_passed"] is True
    # The stream asked for once, the long-poll once (both 404), then never again.
    assert gateway.op_counts["exits"] == 2


async def test_transient_poll_errors_are_retried(make_env, gateway, sandboxes, model_client):
    sandboxes.fail("get_background_job", httpx.ReadTimeout("slow"), httpx.ReadTimeout("slow"))
    state = await run(make_env(), model_client)
    assert state["error"] is None
    assert state["agent_exit_code"] == 0


# ---------------------------------------------------------------- failures at each stage


FAILURES = {
    "register_rejected": (lambda g, s, t: g.fail("register", 400), GatewayRequestError),
    "register_unavailable": (
        lambda g, s, t: g.fail("register", 503, 503, 503),
        GatewayUnavailableError,
    ),
    "tunnel": (lambda g, s, t: t.fail_next.append(OSError("frpc missing")), GatewayTunnelError),
    "sandbox_create": (lambda g, s, t: s.fail("create", RuntimeError("quota")), vf.SandboxError),
    "sandbox_ready": (
        lambda g, s, t: s.fail("wait_for_creation", RuntimeError("stuck")),
        vf.SandboxError,
    ),
    "agent_start": (
        lambda g, s, t: s.fail("start_background_job", RuntimeError("no shell")),
        AgentStartError,
    ),
    "poll": (lambda g, s, t: s.fail("get_background_job", ValueError("bad job")), AgentPollError),
    "trajectory_fetch": (
        lambda g, s, t: g.fail("trajectory", 500),  # a 500 is not retried
        GatewayUnavailableError,
    ),
    "unregister": (lambda g, s, t: g.fail("unregister", 503, 503, 503), GatewayUnavailableError),
    "delete": (
        lambda g, s, t: s.fail("delete", RuntimeError("api down")),
        vf.SandboxError,
    ),
}


@pytest.mark.parametrize("stage", list(FAILURES))
async def test_failure_at_each_stage_is_typed_cleans_up_and_env_stays_usable(
    stage, make_env, gateway, sandboxes, tunnels, model_client
):
    inject, error_type = FAILURES[stage]
    inject(gateway, sandboxes, tunnels)
    env = make_env()
    state = await run(env, model_client)

    assert isinstance(state["error"], error_type), state["error"]
    assert isinstance(state["error"], vf.InfraError)
    # Any error, a teardown failure too, means the rollout must not train as clean.
    assert state["stop_condition"] == "has_error"
    assert state["is_completed"] is True
    if stage == "unregister":
        # The gateway's idle TTL reclaims it; the env still tried once, then moved on.
        assert gateway.op_counts["unregister"] == 3
    else:
        assert gateway.active == []
    if stage == "delete":
        assert env.active_sandboxes == {state["sandbox_id"]}  # teardown retries it
        env.teardown_sandboxes()
    assert sandboxes.alive == []

    # The env is still usable: the next rollout succeeds and cleans up.
    gateway.rollouts.clear()
    ok = await run(env, model_client, 1)
    assert ok["error"] is None and ok["tests_passed"] is True
    assert gateway.active == [] and sandboxes.alive == []


async def test_post_rollout_failure_is_typed_and_sandbox_still_deleted(
    make_env, gateway, sandboxes, model_client
):
    env = make_env()

    async def broken(state: vf.State) -> None:
        raise KeyError("missing file")

    env.post_rollout = broken  # type: ignore[method-assign]
    state = await run(env, model_client)
    assert isinstance(state["error"], PostRolloutError)
    assert_nothing_left(gateway, sandboxes)


async def test_post_rollout_runs_while_the_sandbox_is_alive(
    make_env, gateway, sandboxes, model_client
):
    env = make_env()
    seen_alive: list[bool] = []

    async def check(state: vf.State) -> None:
        seen_alive.append(state["sandbox_id"] in sandboxes.alive)

    env.post_rollout = check  # type: ignore[method-assign]
    await run(env, model_client)
    assert seen_alive == [True]


async def test_retried_register_that_had_landed_counts_as_success(
    make_env, gateway, sandboxes, model_client
):
    # First attempt lands, but its answer is lost (connection dropped): the retry gets 409.
    original = gateway.handle
    dropped = {"done": False}

    async def lossy(request: httpx.Request) -> httpx.Response:
        response = await original(request)
        if request.url.path.endswith("/register") and not dropped["done"]:
            dropped["done"] = True
            raise httpx.ReadError("connection reset by peer")
        return response

    env = make_env(gateway={"transport": httpx.MockTransport(lossy)})
    state = await run(env, model_client)
    assert state["error"] is None
    assert gateway.op_counts["register"] == 2


# ---------------------------------------------------------------- cancellation


CANCEL_POINTS = ["register", "tunnel", "sandbox_create", "agent_running", "trajectory_fetch"]


@pytest.mark.parametrize("point", CANCEL_POINTS)
async def test_cancellation_at_each_stage_cancels_and_cleans_up(
    point, make_env, gateway, sandboxes, tunnels, model_client
):
    reached = asyncio.Event()
    original = gateway.handle

    async def gated(request: httpx.Request) -> httpx.Response:
        op = request.url.path.rsplit("/", 1)[-1]
        if op == point or (point == "trajectory_fetch" and op == "trajectory"):
            reached.set()
            await asyncio.sleep(30)
        return await original(request)

    if point == "tunnel":

        class SlowProvider(FakeTunnelProvider):
            async def open(self, gateway_url: str, host: str, port: int):  # type: ignore[override]
                reached.set()
                await asyncio.sleep(30)
                return await super().open(gateway_url, host, port)

        tunnels = SlowProvider()
    if point == "sandbox_create":
        # Creation completes after the cancel: the sandbox must be deleted on arrival.
        sandboxes.create_latency = lambda: (reached.set(), 0.3)[1]
    if point == "agent_running":

        async def forever(sandbox: FakeSandbox) -> int:
            reached.set()
            await asyncio.sleep(30)
            return 0

        sandboxes.agent = forever

    env = make_env(gateway={"transport": httpx.MockTransport(gated), "tunnel_provider": tunnels})
    task = asyncio.ensure_future(run(env, model_client))
    await asyncio.wait_for(reached.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    registered = point != "register"
    if registered:
        assert len(gateway.cancelled) == 1
    assert gateway.active == []
    await asyncio.sleep(0.5)  # a sandbox whose creation was cancelled is deleted on arrival
    assert sandboxes.alive == []
    sandboxes.agent = two_turn_agent(gateway)
    ok = await asyncio.wait_for(run(make_env(), model_client, 1), 10)
    assert ok["error"] is None


# ---------------------------------------------------------------- malformed input, teardown


@pytest.mark.parametrize(
    "row",
    [
        {**task_row(0), "prompt": [{"role": "wizard", "content": "hi"}]},
        {**task_row(0), "info": "{not json"},
    ],
    ids=["unknown-role", "info-not-json"],
)
async def test_a_malformed_row_ends_as_a_typed_error(
    row, make_env, gateway, sandboxes, model_client
):
    from rollout_gateway import RolloutInputError

    env = make_env()
    state = await env.rollout(row, model_client, "policy-model", {})
    assert isinstance(state["error"], RolloutInputError)
    assert isinstance(state["error"], vf.InfraError)
    assert state["stop_condition"] == "has_error" and state["is_completed"] is True
    assert gateway.calls == [] and sandboxes.alive == []
    ok = await run(env, model_client, 1)  # the env is still usable
    assert ok["error"] is None


async def test_teardown_with_rollouts_in_flight_ends_them_and_leaves_nothing_open(
    make_env, gateway, sandboxes, tunnels, model_client
):
    started = asyncio.Event()

    async def forever(sandbox: FakeSandbox) -> int:
        started.set()
        await asyncio.Event().wait()
        return 0

    sandboxes.agent = forever
    env = make_env()
    tasks = [asyncio.ensure_future(run(env, model_client, i)) for i in range(3)]
    await started.wait()
    while len(sandboxes.sandboxes) < 3 or gateway.op_counts["register"] < 3:
        await asyncio.sleep(0.001)
    await env._teardown()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert gateway.active == [] and sandboxes.alive == []
    assert all(not h.alive for h in tunnels.handles)
    assert sorted(gateway.cancelled) == sorted(gateway.unregistered)
