"""Fixtures shared by the mixin, client, tunnel and trajectory tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from stacks import STACK, ignored_paths

from rollout_gateway.admin_token import forget_admin_tokens
from rollout_gateway.settings import GatewaySettings

#: Tests of the other verifiers stack are not collected (see tests/stacks.py).
collect_ignore = ignored_paths()

if STACK == "classic":  # the fixtures below serve the classic (verifiers 0.3) tests
    import verifiers as vf
    from core_world import no_wait
    from helpers import (
        FAST_POLL,
        FAST_RETRY,
        GATEWAY_BASE_URL,
        GatewayTestEnv,
        two_turn_agent,
    )
    from openai import AsyncOpenAI

    from rollout_gateway.testing import FakeGateway, FakeSandboxClient, FakeTunnelProvider


@pytest.fixture(autouse=True)
def _fresh_admin_tokens() -> None:
    """Each test reads the admin token from its own environment (the env side keeps a
    token it read in memory, process-wide)."""
    forget_admin_tokens()


@pytest.fixture
def gateway() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
def tunnels() -> FakeTunnelProvider:
    return FakeTunnelProvider()


@pytest.fixture
def sandboxes(gateway: FakeGateway) -> FakeSandboxClient:
    client = FakeSandboxClient(two_turn_agent(gateway))
    gateway.watch(client)  # the launch wrapper's start and exit reports
    return client


@pytest.fixture
def model_client() -> vf.Client:
    return vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=GATEWAY_BASE_URL, api_key="x"))


@pytest.fixture
async def make_env(
    gateway: FakeGateway, sandboxes: FakeSandboxClient, tunnels: FakeTunnelProvider
) -> AsyncIterator[Callable[..., GatewayTestEnv]]:
    """Build gateway envs on the fakes; every env is torn down after the test."""
    envs: list[GatewayTestEnv] = []

    def build(**overrides: Any) -> GatewayTestEnv:
        settings = GatewaySettings(
            tunnel_provider=tunnels,
            transport=gateway.transport(),
            retry=FAST_RETRY,
            poll=FAST_POLL,
            sleep=no_wait,
        )
        changes = overrides.pop("gateway", {})
        options: dict[str, Any] = {
            "sandbox_client": sandboxes,
            "gateway": settings.replace(**changes),
            "sandbox_creations_per_minute": None,
            "max_retries": 0,
        }
        options.update(overrides)
        env = GatewayTestEnv(**options)
        envs.append(env)
        return env

    yield build
    for env in envs:
        await env._teardown()
