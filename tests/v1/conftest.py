"""Fixtures of the verifiers v1 adapter tests: a real scripted model and gateway on loopback.

v1's harness runs the agent as a real subprocess, which reaches the gateway over TCP, so
the servers run in-process on free loopback ports. The adapter's control-plane calls go
through :class:`SpyTransport`, which records every call (and every trajectory answer).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarness
from fix_bug_v1.harness import run_program

from rollout_gateway.client import RetryPolicy
from rollout_gateway.protocol import expand_delta_steps
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.v1 import GatewayInterception, GatewayInterceptionConfig

ADMIN_TOKEN = "v1-tests-admin-token-0123456789"
#: The local sandboxes' root of the side-by-side tests (one per test process; a short
#: path, as bwrap's mounts of it are listed in every sandbox's command line), removed at
#: the end of the session.
SANDBOX_ROOT = f"/tmp/rg-sbs-{os.getpid()}"
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.0, max_backoff=0.0, jitter=0.0)


class SpyTransport(httpx.AsyncBaseTransport):
    """A real HTTP transport that records ``(method, path)`` and trajectory answers."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.calls: list[tuple[str, str]] = []
        self.trajectories: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.method, request.url.path))
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/trajectory") and response.status_code == 200:
            body = await response.aread()
            answer = json.loads(body)
            if answer.get("format") == "delta":  # what the client asks for: kept expanded
                answer["trajectory"] = expand_delta_steps(answer["trajectory"])
            self.trajectories.append(answer)
            return httpx.Response(response.status_code, headers=response.headers, content=body)
        return response

    def count(self, suffix: str) -> int:
        """How many calls went to a path ending in ``suffix``."""
        return sum(1 for _, path in self.calls if path.endswith(suffix))

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class Stack:
    """The running servers."""

    model_url: str
    gateway_url: str
    gateway_app: Any
    spies: list[SpyTransport] = field(default_factory=list)

    @property
    def gateway(self) -> Any:
        """The gateway's state (registry, metrics)."""
        return self.gateway_app.state.gateway

    def agent_config(self, harness: Any, **overrides: Any) -> vf.AgentConfig:
        """An agent on the scripted model through the gateway, on the subprocess runtime."""
        options: dict[str, Any] = {
            "model": "scripted",
            "client": vf.EvalClientConfig(base_url=f"{self.gateway_url}/v1"),
            "harness": harness,
            "runtime": vf.SubprocessConfig(),
        }
        options.update(overrides)
        return vf.AgentConfig(**options)


@pytest.fixture(scope="session", autouse=True)
def _remove_sandbox_root() -> Iterator[None]:
    yield
    shutil.rmtree(SANDBOX_ROOT, ignore_errors=True)


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as exits:
        model_root = await exits.enter_async_context(running_server(create_scripted_model_app()))
        app = create_app(GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=ADMIN_TOKEN))
        gateway_root = await exits.enter_async_context(running_server(app))
        yield Stack(f"{model_root}/v1", gateway_root, app)


@pytest.fixture
async def make_interception(
    stack: Stack,
) -> AsyncIterator[Callable[..., Any]]:
    """Start gateway interceptions (direct tunnel, spy transport); all stopped at the end."""
    async with contextlib.AsyncExitStack() as exits:

        async def build(**config: Any) -> tuple[GatewayInterception, SpyTransport]:
            spy = SpyTransport()
            exits.push_async_callback(spy.aclose)
            options: dict[str, Any] = {"tunnel": "direct", **config}
            fallback = options.pop("fallback_interception", None)
            interception = GatewayInterception(
                GatewayInterceptionConfig(**options),
                transport=spy,
                retry=FAST_RETRY,
                admin_token=ADMIN_TOKEN,
                fallback=fallback,
            )
            await exits.enter_async_context(interception)
            return interception, spy

        yield build


def script_harness(filename: str, source: str) -> type[FixBugHarness]:
    """The example's harness running ``source`` (a Python agent using the OpenAI SDK) as
    its program, with the endpoint, key and model the interception gives it."""

    class ScriptHarness(FixBugHarness):
        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):  # type: ignore[override]
            await runtime.write(filename, source.encode())
            env = {"OPENAI_BASE_URL": endpoint, "OPENAI_API_KEY": secret, "OPENAI_MODEL": ctx.model}
            return await run_program(runtime, [sys.executable, filename], env)

    return ScriptHarness
