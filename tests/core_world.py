"""A fake world for the lifecycle core's tests: gateway, tunnels and sandboxes, no verifiers.

:class:`SandboxHooks` drives an agent in a :class:`FakeSandboxClient` sandbox the way an
adapter would, and records which steps ran, in order; ``faults`` makes any step raise,
hang, or cancel the rollout's own task when it is reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway.agent_wait import poll_until_exit, wait_for_agent
from rollout_gateway.client import RetryPolicy
from rollout_gateway.launch import agent_launch_command
from rollout_gateway.lifecycle import AgentExit, GatewayRollout, RolloutHooks
from rollout_gateway.polling import PollPolicy
from rollout_gateway.resources import GatewayResources
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.testing import (
    FakeGateway,
    FakeSandbox,
    FakeSandboxClient,
    FakeTunnelProvider,
    rollout_id_of,
)

GATEWAY_URL = "http://gateway.test:8000"


async def no_wait(seconds: float) -> None:
    """A sleep that only yields: polling and backoff cost no wall time in tests."""
    await asyncio.sleep(0)


NO_WAIT_RETRY = RetryPolicy(
    max_attempts=3, initial_backoff=0, max_backoff=0, jitter=0, sleep=no_wait
)
NO_WAIT_POLL = PollPolicy(min_interval=0.001, max_interval=0.001)


def one_turn_agent(gateway: FakeGateway) -> Callable[[FakeSandbox], Awaitable[int]]:
    """An agent that makes one model call through the gateway and exits 0."""

    async def agent(sandbox: FakeSandbox) -> int:
        rid = rollout_id_of(sandbox)
        gateway.add_turn(
            rid,
            [{"role": "user", "content": "fix it"}],
            [{"role": "assistant", "content": "done"}],
        )
        return 0

    return agent


@dataclass
class World:
    """The fakes, and resources wired to them."""

    gateway: FakeGateway = field(default_factory=FakeGateway)
    tunnels: FakeTunnelProvider = field(default_factory=FakeTunnelProvider)
    sandboxes: FakeSandboxClient = field(default_factory=FakeSandboxClient)
    settings: GatewaySettings | None = None
    resources: GatewayResources = field(init=False)

    def __post_init__(self) -> None:
        base = GatewaySettings(
            gateway_url=GATEWAY_URL,
            transport=self.gateway.transport(),
            retry=NO_WAIT_RETRY,
            poll=NO_WAIT_POLL,
            sleep=no_wait,
            tunnel_liveness_interval=0.01,
        )
        self.settings = self.settings or base
        self.resources = GatewayResources(self.settings, self.tunnels)
        if self.sandboxes.agent.__name__ == "_exit_zero":
            self.sandboxes.agent = one_turn_agent(self.gateway)
        self.gateway.watch(self.sandboxes)

    def rollout(self) -> tuple[GatewayRollout, SandboxHooks]:
        rollout = GatewayRollout(self.resources)
        rollout.record.gateway_url = GATEWAY_URL
        return rollout, SandboxHooks(rollout, self.sandboxes)

    def leaks(self) -> dict[str, Any]:
        """What is left: registrations, live sandboxes, running tunnels."""
        return {
            "registered": self.gateway.active,
            "sandboxes": self.sandboxes.alive,
            "tunnels": [h.url for h in self.tunnels.handles if h.alive],
        }


Fault = str  # "raise", "hang" or "cancel"


class SandboxHooks(RolloutHooks):
    """Core steps over a fake prime-style sandbox client; ``faults[step]`` injects a fault."""

    def __init__(self, rollout: GatewayRollout, sandboxes: FakeSandboxClient) -> None:
        super().__init__(rollout)
        self.sandboxes = sandboxes
        self.ran: list[str] = []
        self.faults: dict[str, Fault] = {}
        self.job: Any = None

    async def _enter(self, step: str) -> None:
        self.ran.append(step)
        fault = self.faults.get(step)
        if fault == "raise":
            raise RuntimeError(f"injected failure in {step}")
        if fault == "hang":
            await asyncio.Event().wait()
        if fault == "cancel":
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)

    async def register(self) -> None:
        await self._enter("register")
        await self.rollout.register(model="policy", sampling_params={"temperature": 1.0})

    async def open_tunnel(self) -> None:
        await self._enter("open_tunnel")
        await super().open_tunnel()

    async def launch(self) -> None:
        await self._enter("launch")
        request = _Request(self.rollout.rollout_id, self.rollout.agent_env("policy"))
        sandbox = await self.sandboxes.create(request)
        self.rollout.record.sandbox_id = sandbox.id
        self.rollout.record.agent_started = True
        reports = self.rollout.settings.exit_reports
        command = agent_launch_command("agent", report_exit=reports)
        self.job = await self.sandboxes.start_background_job(sandbox.id, command)
        self.rollout.record.agent_reports = reports

    async def wait(self) -> None:
        await self._enter("wait")
        sandbox_id = self.rollout.record.sandbox_id

        async def probe() -> AgentExit | None:
            status = await self.sandboxes.get_background_job(sandbox_id, self.job)
            return AgentExit(status.exit_code) if status.completed else None

        await wait_for_agent(self.rollout, poll_until_exit(self.rollout, probe))

    async def fetch(self) -> None:
        await self._enter("fetch")
        await super().fetch()

    async def check(self) -> None:
        await self._enter("check")

    async def score(self) -> None:
        await self._enter("score")

    async def release(self) -> None:
        await self._enter("release")

    async def stop_agent(self) -> None:
        await self._enter("stop_agent")
        sandbox = self.sandboxes.sandboxes[self.rollout.record.sandbox_id or ""]
        if sandbox.agent_task is not None:
            sandbox.agent_task.cancel()

    async def cancel(self) -> None:
        await self._enter("cancel")
        await super().cancel()

    async def unregister(self) -> None:
        await self._enter("unregister")
        await super().unregister()

    async def delete_sandbox(self) -> None:
        await self._enter("delete_sandbox")
        if self.rollout.record.sandbox_id:
            await self.sandboxes.delete(self.rollout.record.sandbox_id)


@dataclass
class _Request:
    name: str
    environment_vars: dict[str, str]
