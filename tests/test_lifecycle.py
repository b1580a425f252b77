"""GatewayRollout: one rollout's lifecycle and its one finalize path, on the fake world."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections import Counter
from typing import Any

import httpx
import pytest
from core_world import GATEWAY_URL, World, no_wait

from rollout_gateway.errors import (
    AgentPollError,
    GatewayError,
    GatewayTunnelError,
    PostRolloutError,
    RolloutInfraError,
    SandboxError,
)
from rollout_gateway.lifecycle import (
    STOP_AGENT_TIMEOUT,
    STOP_CANCELLED,
    STOP_COMPLETED,
    STOP_HAS_ERROR,
    STOP_ROLLOUT_TIMEOUT,
)
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.testing import FakeGateway, FakeSandbox, rollout_id_of

STAGES = ["register", "open_tunnel", "launch", "wait", "fetch", "check"]
FINALIZE_STEPS = ["score", "release", "unregister", "delete_sandbox"]


async def test_happy_path_runs_each_step_once_in_order():
    world = World()
    rollout, hooks = world.rollout()
    await rollout.execute(hooks)
    assert hooks.ran == STAGES + FINALIZE_STEPS
    record = rollout.record
    assert record.error is None and record.stop_condition == STOP_COMPLETED
    assert record.trajectory is not None and record.trajectory["num_turns"] == 1
    assert record.agent_exit is not None and record.agent_exit.exit_code == 0
    assert world.gateway.op_counts - Counter(exits=99) == Counter(
        register=1, trajectory=1, unregister=1
    )
    assert world.leaks() == {
        "registered": [],
        "sandboxes": [],
        "tunnels": [world.tunnels.handles[0].url],
    }
    await world.resources.aclose()
    assert world.leaks()["tunnels"] == []


async def test_a_finished_rollout_is_freed_at_once_not_by_the_garbage_collector():
    # A reference cycle per rollout keeps its record and trajectory until the collector
    # runs: under a burst that is memory held for nothing and longer collections.
    world = World()
    rollout, hooks = world.rollout()
    gc.disable()
    try:
        await rollout.execute(hooks)
        assert rollout.record.trajectory is not None
        refs = [weakref.ref(rollout), weakref.ref(rollout.record), weakref.ref(rollout.steps)]
        del rollout, hooks
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()
    await world.resources.aclose()


# ---------------------------------------------------------------- the fault matrix


async def _run_with_fault(step: str, fault: str) -> tuple[World, Any, Any, bool]:
    world = World(settings=None)
    world.settings = world.settings.replace(finalize_step_timeout=0.2)  # type: ignore[union-attr]
    world.resources = type(world.resources)(world.settings, world.tunnels)
    rollout, hooks = world.rollout()
    hooks.faults[step] = fault
    cancelled = False
    try:
        await rollout.execute(hooks, timeout=0.3)
    except asyncio.CancelledError:
        cancelled = True
    await world.resources.aclose()
    return world, rollout, hooks, cancelled


@pytest.mark.parametrize("fault", ["raise", "hang", "cancel"])
@pytest.mark.parametrize("step", STAGES + FINALIZE_STEPS)
async def test_fault_matrix_leaves_nothing_behind(step: str, fault: str):
    before = asyncio.all_tasks()
    world, rollout, hooks, cancelled = await _run_with_fault(step, fault)
    record = rollout.record

    leaks = world.leaks()
    if step == "unregister":  # the step that would have unregistered failed: nothing else can
        assert leaks["registered"] in ([], [rollout.rollout_id])
        leaks["registered"] = []
    if step == "delete_sandbox":
        assert len(leaks["sandboxes"]) <= 1
        leaks["sandboxes"] = []
    assert leaks == {"registered": [], "sandboxes": [], "tunnels": []}
    assert asyncio.all_tasks() - before == set(), "tasks left running"

    # Every step ran at most once, and teardown steps ran whatever failed.
    assert len(hooks.ran) == len(set(hooks.ran)), hooks.ran
    if "register" in hooks.ran:
        assert "delete_sandbox" in hooks.ran
    # Unregistered iff the register request may have reached the gateway (never for a
    # rollout whose register did not go out: an override's unregister may assume one).
    assert ("unregister" in hooks.ran) == record.register_sent
    # Exactly one error, typed, and exactly one stop condition.
    if fault == "cancel" and step in STAGES:
        assert cancelled and record.stop_condition == STOP_CANCELLED
    elif fault == "hang" and step in STAGES:
        assert record.stop_condition == STOP_ROLLOUT_TIMEOUT or (
            record.stop_condition == STOP_HAS_ERROR
        )
    else:
        assert record.error is not None, (step, fault)
        assert isinstance(record.error, RolloutInfraError)
        assert record.stop_condition == STOP_HAS_ERROR
        if step == "score":
            assert isinstance(record.error, PostRolloutError)
    if step in STAGES and fault == "raise":
        assert "score" not in hooks.ran, "an infrastructure failure must not be scored"


async def test_stage_errors_are_typed_by_stage():
    expected = {
        "register": GatewayError,
        "open_tunnel": GatewayTunnelError,
        "launch": SandboxError,
        "wait": AgentPollError,
        "fetch": GatewayError,
        "release": RolloutInfraError,
        "unregister": GatewayError,
        "delete_sandbox": SandboxError,
    }
    for step, error_type in expected.items():
        _, rollout, _, _ = await _run_with_fault(step, "raise")
        assert isinstance(rollout.record.error, error_type), (step, rollout.record.error)


# ---------------------------------------------------------------- faults that must end right


async def test_a_tunnel_dying_while_the_agent_runs_ends_the_rollout_at_once():
    world = World()
    agent_may_exit = asyncio.Event()

    async def slow_agent(sandbox: FakeSandbox) -> int:
        world.gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        await agent_may_exit.wait()
        return 0

    world.sandboxes.agent = slow_agent
    rollout, hooks = world.rollout()
    task = asyncio.ensure_future(rollout.execute(hooks))
    while not world.tunnels.handles or "wait" not in hooks.ran:
        await asyncio.sleep(0.001)
    world.tunnels.handles[0].alive = False  # frpc died
    await asyncio.wait_for(task, 5)  # long before any agent timeout (6 h by default)

    record = rollout.record
    assert isinstance(record.error, GatewayTunnelError)
    assert record.stop_condition == STOP_HAS_ERROR
    assert "score" not in hooks.ran  # the half-finished trajectory is not scored
    assert "cancel" in hooks.ran and world.gateway.cancelled == [rollout.rollout_id]
    assert world.leaks()["registered"] == [] and world.leaks()["sandboxes"] == []
    await world.resources.aclose()


async def test_a_dead_tunnel_is_replaced_in_the_background():
    world = World()
    first = await world.resources.tunnels.lease(GATEWAY_URL)
    world.tunnels.handles[0].alive = False
    for _ in range(1000):
        if len(world.tunnels.opened) == 2:
            break
        await asyncio.sleep(0.001)
    assert len(world.tunnels.opened) == 2, "no replacement was opened in the background"
    assert first.is_dead
    second = await world.resources.tunnels.lease(GATEWAY_URL)
    assert second.url == world.tunnels.handles[1].url != first.url
    assert len(world.tunnels.opened) == 2  # the lease found the replacement ready
    await world.resources.aclose()


async def test_cancelled_while_register_is_in_flight_leaves_nothing_registered():
    world = World()
    answered = asyncio.Event()
    transport = world.gateway.transport()

    class SlowAnswer(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await transport.handle_async_request(request)
            if request.url.path.endswith("/register"):
                answered.set()
                await asyncio.Event().wait()  # the gateway registered; the answer never comes
            return response

    world.settings = world.settings.replace(transport=SlowAnswer())  # type: ignore[union-attr]
    world.resources = type(world.resources)(world.settings, world.tunnels)
    rollout, hooks = world.rollout()
    task = asyncio.ensure_future(rollout.execute(hooks))
    await answered.wait()
    assert world.gateway.active == [rollout.rollout_id]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert world.gateway.active == []
    assert world.gateway.unregistered == [rollout.rollout_id]
    await world.resources.aclose()


async def test_a_register_retried_after_a_lost_answer_keeps_the_api_key():
    gateway = FakeGateway(issue_api_keys=True)
    transport = gateway.transport()

    class LoseFirstAnswer(httpx.AsyncBaseTransport):
        lost = False

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await transport.handle_async_request(request)
            if request.url.path.endswith("/register") and not self.lost:
                self.lost = True
                raise httpx.ReadError("connection reset after the gateway registered")
            return response

    world = World(gateway=gateway)
    world.settings = world.settings.replace(transport=LoseFirstAnswer())  # type: ignore[union-attr]
    world.resources = type(world.resources)(world.settings, world.tunnels)
    rollout, hooks = world.rollout()
    await rollout.execute(hooks)
    issued = gateway.op_counts["register"]
    assert issued == 2  # the retry got a 409: the first attempt had landed
    record = rollout.record
    assert record.error is None
    assert record.api_key is not None
    sandbox = next(iter(world.sandboxes.sandboxes.values()))
    assert sandbox.env_vars["OPENAI_API_KEY"] == record.api_key
    assert gateway.unregistered == [rollout.rollout_id]
    await world.resources.aclose()


async def test_a_timed_out_agent_is_cancelled_stopped_then_scored():
    world = World()
    world.settings = world.settings.replace(agent_timeout=0.05)  # type: ignore[union-attr]
    world.resources = type(world.resources)(world.settings, world.tunnels)

    async def looping_agent(sandbox: FakeSandbox) -> int:
        world.gateway.add_turn(rollout_id_of(sandbox), [{"role": "user", "content": "x"}], [])
        await asyncio.Event().wait()
        return 0

    world.sandboxes.agent = looping_agent
    rollout, hooks = world.rollout()
    await rollout.execute(hooks)
    record = rollout.record
    assert record.agent_timed_out and record.error is None
    assert record.stop_condition == STOP_AGENT_TIMEOUT
    # The gateway refuses its later turns, the agent is stopped, THEN it is scored.
    order = [s for s in hooks.ran if s in ("cancel", "stop_agent", "fetch", "score")]
    assert order == ["fetch", "cancel", "stop_agent", "score"] or order == [
        "cancel",
        "stop_agent",
        "fetch",
        "score",
    ]
    assert hooks.ran.index("stop_agent") < hooks.ran.index("score")
    assert record.trajectory is not None and record.trajectory["num_turns"] == 1
    await world.resources.aclose()


async def test_closing_resources_ends_rollouts_in_flight_and_leaves_nothing_open():
    world = World()

    async def forever(sandbox: FakeSandbox) -> int:
        await asyncio.Event().wait()
        return 0

    world.sandboxes.agent = forever
    pairs = [world.rollout() for _ in range(5)]
    tasks = [asyncio.ensure_future(r.execute(h)) for r, h in pairs]
    while sum("wait" in h.ran for _, h in pairs) < 5:
        await asyncio.sleep(0.001)
    await world.resources.aclose()
    assert all(t.done() for t in tasks)
    assert world.leaks() == {"registered": [], "sandboxes": [], "tunnels": []}
    with pytest.raises(GatewayError):
        world.resources.client(GATEWAY_URL)  # nothing is re-created after close


def test_settings_reject_bad_values_naming_the_option():
    from rollout_gateway.errors import GatewayConfigError

    for bad in (
        {"agent_timeout": 0},
        {"agent_timeout": float("nan")},
        {"gateway_port": 0},
        {"gateway_url": "ftp://x"},
        {"tunnel_provider": "ssh"},
        {"finalize_step_timeout": -1},
        {"no_such_option": 1},
    ):
        with pytest.raises(GatewayConfigError) as info:
            GatewaySettings().replace(**bad)
        assert next(iter(bad)) in str(info.value)
    assert GatewaySettings(agent_timeout=None).agent_timeout is None
    assert GatewaySettings.coerce({"poll": {"min_interval": 0.5}}).poll.min_interval == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        {"exit_reports": "false"},  # JSON from vf-eval -a: a string is not a flag
        {"allow_empty_trajectory": 1},
        {"retry": {"max_attempts": 0}},
        {"retry": {"no_such_field": 1}},
        {"retry": 5},
        {"poll": {"min_interval": 0}},
        {"poll": "fast"},
        {"tunnel_liveness_interval": float("inf")},
        {"tunnel_health_check_interval": True},
        {"agent_stop_grace": float("inf")},
        {"agent_timeout": True},
        {"gateway_url": 8000},
        {"tunnel_provider": 5},
        {"admin_token_env": None},
    ],
)
def test_every_setting_is_checked_at_construction_naming_it(bad):
    from rollout_gateway.errors import GatewayConfigError

    [name] = bad
    with pytest.raises(GatewayConfigError, match=name):
        GatewaySettings.coerce(bad)
    with pytest.raises(GatewayConfigError, match=name):
        GatewaySettings(**bad)


def test_policy_mappings_become_policies():
    from rollout_gateway import PollPolicy, RetryPolicy

    settings = GatewaySettings(retry={"max_attempts": 2}, poll={"safety_interval": 3.0})
    assert settings.retry == RetryPolicy(max_attempts=2)
    assert settings.poll == PollPolicy(safety_interval=3.0)


async def test_no_wait_sleep_keeps_polling_hermetic():
    world = World()
    assert world.settings is not None and world.settings.sleep is no_wait
