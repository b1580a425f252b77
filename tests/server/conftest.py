"""Fixtures of the gateway server tests: in-process apps wired with httpx transports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_gateway.scripted import build_completion, create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app

UPSTREAM = "http://upstream-a/v1"


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def script(*steps: Any) -> str:
    """A user message text carrying a scripted-model script."""
    return f"Solve the task. <script>{json.dumps(list(steps))}</script>"


@dataclass
class RecordingUpstream:
    """An upstream app that answers like the scripted model and records what it got.

    ``status``/``error_body`` make it fail; ``latency_s`` delays answers; ``with_tokens``
    false drops the vLLM token fields (a plain OpenAI server). ``events`` logs
    ``("start"|"end", first user message, time)`` to check turn ordering.
    """

    status: int = 200
    error_body: Any = None
    latency_s: float = 0.0
    with_tokens: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)
    #: The requests' bodies as sent.
    bodies: list[bytes] = field(default_factory=list)
    events: list[tuple[str, str, float]] = field(default_factory=list)
    model_probes: int = 0

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            raw = await request.body()
            self.bodies.append(raw)
            body = json.loads(raw)
            self.requests.append(body)
            tag = str(body["messages"][-1].get("content"))
            self.events.append(("start", tag, time.perf_counter()))
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            self.events.append(("end", tag, time.perf_counter()))
            if self.status != 200:
                return JSONResponse(self.error_body, status_code=self.status)
            completion = build_completion(body, "recorded")
            if not self.with_tokens:
                completion.pop("prompt_token_ids", None)
                for choice in completion["choices"]:
                    choice.pop("token_ids", None)
                    choice["logprobs"] = None
            return JSONResponse(completion)

        async def models(request: Request) -> Response:
            self.model_probes += 1
            return JSONResponse({"object": "list", "data": []})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )


class SwitchableTransport(httpx.AsyncBaseTransport):
    """Delegates to an app, or fails to connect while ``down`` is true."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app)
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


#: Admin token of the default test gateway; the harness client sends it on every call.
ADMIN_TOKEN = "test-admin-token-0123456789"


@dataclass
class GatewayHarness:
    """A gateway app with its lifespan running and a client to it.

    The client carries the admin token; chat calls carry the rollout's key (from
    :meth:`register`) unless the caller passes its own ``Authorization`` header.
    """

    app: Starlette
    client: httpx.AsyncClient
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    async def register(self, rollout_id: str, **body: Any) -> httpx.Response:
        payload = {"model": "policy", "sampling_params": {}, "max_turns": -1, "max_seq_len": None}
        payload.update(body)
        r = await self.client.post(f"/v1/rollouts/{rollout_id}/register", json=payload)
        if r.status_code == 200 and "api_key" in r.json():
            self.keys[rollout_id] = r.json()["api_key"]
        return r

    def agent_headers(self, rollout_id: str, headers: Any = None) -> dict[str, str]:
        """Headers of an agent's call: its rollout key, replaced by ``headers``."""
        out = {"Authorization": f"Bearer {self.keys.get(rollout_id, 'none')}"}
        out.update(headers or {})
        return out

    async def chat(self, rollout_id: str, body: Any, **kwargs: Any) -> httpx.Response:
        if isinstance(body, list):
            body = {"model": "agent-model", "messages": body}
        kwargs["headers"] = self.agent_headers(rollout_id, kwargs.get("headers"))
        return await self.client.post(
            f"/v1/rollouts/{rollout_id}/chat/completions", json=body, **kwargs
        )

    async def trajectory(self, rollout_id: str, **kwargs: Any) -> httpx.Response:
        return await self.client.get(f"/v1/rollouts/{rollout_id}/trajectory", **kwargs)


GatewayFactory = Callable[..., Awaitable[GatewayHarness]]


@pytest.fixture
async def make_gateway() -> AsyncIterator[GatewayFactory]:
    """Factory: ``await make_gateway(upstream=app_or_transport_map, **config_fields)``.

    ``upstream`` is an ASGI app (default: the scripted model) served at :data:`UPSTREAM`,
    or a mapping ``{base_url: httpx transport}`` with ``upstreams`` set accordingly.
    """
    async with contextlib.AsyncExitStack() as stack:

        async def factory(
            upstream: Any = None, *, clock: Callable[[], float] = time.monotonic, **fields: Any
        ) -> GatewayHarness:
            if isinstance(upstream, dict):
                transport: Any = upstream
                fields.setdefault("upstreams", list(upstream))
            else:
                transport = httpx.ASGITransport(upstream or create_scripted_model_app())
                fields.setdefault("upstreams", [UPSTREAM])
            if not fields.get("open_control_plane"):
                fields.setdefault("admin_token", ADMIN_TOKEN)
            app = create_app(
                GatewayConfig.from_fields(**fields), clock=clock, upstream_transport=transport
            )
            await stack.enter_async_context(app.router.lifespan_context(app))
            headers = {}
            if fields.get("admin_token"):
                headers["Authorization"] = f"Bearer {fields['admin_token']}"
            client = await stack.enter_async_context(
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app), base_url="http://gateway", headers=headers
                )
            )
            return GatewayHarness(app, client)

        yield factory


@pytest.fixture
async def gw(make_gateway: GatewayFactory) -> GatewayHarness:
    """A default gateway in front of the scripted model."""
    return await make_gateway()
