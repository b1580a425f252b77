"""Waiting for an agent (rollout_gateway.agent_wait): what the exit channel says decides
how often the sandbox is asked, and a refusal stops the agent at once."""

from __future__ import annotations

import asyncio
from typing import Any

from core_world import NO_WAIT_RETRY, World

from rollout_gateway.agent_wait import poll_until_exit
from rollout_gateway.launch import agent_launch_command
from rollout_gateway.lifecycle import AgentExit
from rollout_gateway.polling import PollPolicy
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.testing import FakeSandbox, FakeSandboxClient, rollout_id_of

POLICY = PollPolicy(min_interval=0.01, max_interval=0.05, safety_interval=30.0, start_grace=0.2)


#: The tunnel monitor's period (it shares the settings' sleep): told apart from the waits.
MONITOR = 7.25


class Waits:
    """The settings' sleep: real waits, each asked-for duration recorded."""

    def __init__(self) -> None:
        self.all: list[float] = []

    @property
    def asked(self) -> list[float]:
        """The waits of the agent's wait (not the tunnel monitor's)."""
        return [w for w in self.all if w != MONITOR]

    async def __call__(self, seconds: float) -> None:
        self.all.append(seconds)
        await asyncio.sleep(seconds)


async def waiting(sandbox: FakeSandbox) -> int:
    await asyncio.Event().wait()  # runs until stopped
    return 0


def world_with(agent: Any, waits: Waits, *, http_client: bool = True) -> World:
    sandboxes = FakeSandboxClient(agent)
    sandboxes.http_client = http_client
    settings = GatewaySettings(
        gateway_url="http://gateway.test:8000",
        retry=NO_WAIT_RETRY,
        poll=POLICY,
        sleep=waits,
        tunnel_provider="direct",
        tunnel_liveness_interval=MONITOR,
    )
    world = World(sandboxes=sandboxes, settings=settings)
    world.settings = settings.replace(transport=world.gateway.transport())
    world.resources = type(world.resources)(world.settings, world.tunnels)
    return world


async def start(world: World, *, wrapper: bool = True) -> tuple[Any, FakeSandbox, Any]:
    rollout, _ = world.rollout()
    await rollout.register(model="policy")
    await rollout.lease_tunnel()
    request = type("R", (), {"name": rollout.rollout_id, "environment_vars": {}})()
    request.environment_vars = rollout.agent_env("policy")
    created = await world.sandboxes.create(request)
    command = agent_launch_command("agent") if wrapper else "agent"
    job = await world.sandboxes.start_background_job(created.id, command)
    rollout.record.agent_reports = wrapper
    return rollout, world.sandboxes.sandboxes[created.id], job


def probe_of(world: World, sandbox: FakeSandbox, job: Any) -> Any:
    async def probe() -> AgentExit | None:
        status = await world.sandboxes.get_background_job(sandbox.id, job)
        return AgentExit(status.exit_code) if status.completed else None

    return probe


async def test_a_refusal_stops_the_agent_and_its_exit_is_confirmed() -> None:
    waits = Waits()
    world = world_with(waiting, waits)
    rollout, sandbox, job = await start(world)
    stopped: list[str] = []

    async def stop_agent() -> None:
        stopped.append(rollout.record.refused)
        assert sandbox.agent_task is not None
        sandbox.agent_task.cancel()
        await asyncio.sleep(0)

    waiter = asyncio.ensure_future(
        poll_until_exit(rollout, probe_of(world, sandbox, job), on_refusal=stop_agent)
    )
    await asyncio.sleep(0.1)
    assert not waiter.done()
    world.gateway.refuse(rollout_id_of(sandbox), "max_turns_reached")
    agent_exit = await asyncio.wait_for(waiter, 5)
    assert stopped == ["max_turns_reached"]
    assert rollout.record.refused == "max_turns_reached"
    assert agent_exit.exit_code == 137  # the stopped job's own exit, confirmed
    await world.resources.aclose()


async def test_with_the_wrappers_start_report_only_the_safety_poll_is_asked() -> None:
    waits = Waits()
    world = world_with(waiting, waits)
    rollout, sandbox, job = await start(world)
    waiter = asyncio.ensure_future(poll_until_exit(rollout, probe_of(world, sandbox, job)))
    await asyncio.sleep(0.3)  # past start_grace
    assert world.sandboxes.calls["get_background_job"] == 0  # heard the start: no probe
    assert waits.asked[-1] == POLICY.safety_interval
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await world.resources.aclose()


async def test_without_a_start_report_the_sandbox_is_polled_adaptively() -> None:
    waits = Waits()
    world = world_with(waiting, waits, http_client=False)  # no curl, wget nor python3
    rollout, sandbox, job = await start(world)
    waiter = asyncio.ensure_future(poll_until_exit(rollout, probe_of(world, sandbox, job)))
    await asyncio.sleep(0.5)
    assert world.sandboxes.calls["get_background_job"] >= 3  # polled, past start_grace
    assert max(waits.asked) <= POLICY.start_grace  # never the safety interval
    sandbox.agent_task.cancel()  # type: ignore[union-attr]
    assert (await asyncio.wait_for(waiter, 5)).exit_code == 137
    await world.resources.aclose()


async def test_an_agent_launched_without_the_wrapper_is_polled_from_the_start() -> None:
    waits = Waits()

    async def quick(sandbox: FakeSandbox) -> int:
        await asyncio.sleep(0.05)
        return 0

    world = world_with(quick, waits)
    rollout, sandbox, job = await start(world, wrapper=False)
    agent_exit = await asyncio.wait_for(poll_until_exit(rollout, probe_of(world, sandbox, job)), 5)
    assert agent_exit.exit_code == 0
    assert max(waits.asked) <= POLICY.max_interval  # no grace, no safety wait
    await world.resources.aclose()


async def test_a_gateway_without_start_reports_passes_the_start_on_as_a_null_exit() -> None:
    # A gateway from before "started" keeps the wrapper's start report as an exit code of
    # null, which no exit report of the wrapper has: it still counts as the start.
    waits = Waits()
    world = world_with(waiting, waits, http_client=False)
    rollout, sandbox, job = await start(world)
    world.gateway.exit_board.report(rollout_id_of(sandbox), None)  # no "started" field
    waiter = asyncio.ensure_future(poll_until_exit(rollout, probe_of(world, sandbox, job)))
    await asyncio.sleep(0.3)  # past start_grace
    assert world.sandboxes.calls["get_background_job"] == 0
    assert waits.asked[-1] == POLICY.safety_interval
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await world.resources.aclose()
