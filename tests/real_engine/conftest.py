"""The real-engine suite: the gateway in front of a real vLLM named by the environment.

``ROLLOUT_GATEWAY_REAL_VLLM_URL`` is the engine's OpenAI base URL
(``http://127.0.0.1:8001/v1``, e.g. ``tools/real-vllm/serve.sh``'s); without it every
test here is skipped, saying so. ``ROLLOUT_GATEWAY_REAL_VLLM_MODEL`` names the served
model (default: the first one ``/models`` lists). ``.ci/run`` starts one and sets both.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from rollout_gateway.server import GatewayConfig, create_app, running_server

URL_VAR = "ROLLOUT_GATEWAY_REAL_VLLM_URL"
MODEL_VAR = "ROLLOUT_GATEWAY_REAL_VLLM_MODEL"
ADMIN = "real-engine-admin-token-0123456789"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this directory's tests, loudly, when no real engine is named."""
    if os.environ.get(URL_VAR):
        return
    skip = pytest.mark.skip(
        reason=f"no real vLLM: set {URL_VAR} to its OpenAI base URL "
        "(tools/real-vllm/serve.sh starts one; bash .ci/run real-engine does it)"
    )
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@dataclass
class RealGateway:
    """A gateway (in-process, loopback) in front of the real engine, and clients."""

    engine_url: str
    model: str
    control: httpx.AsyncClient
    engine: httpx.AsyncClient
    keys: dict[str, str] = field(default_factory=dict)

    async def register(self, rollout_id: str, **body: Any) -> dict[str, Any]:
        payload: dict[str, Any] = {"model": self.model, "sampling_params": {}, "max_turns": -1}
        payload.update(body)
        r = await self.control.post(f"/v1/rollouts/{rollout_id}/register", json=payload)
        assert r.status_code == 200, r.text
        self.keys[rollout_id] = r.json()["api_key"]
        return r.json()

    def agent(self, rollout_id: str) -> dict[str, str]:
        """The agent's headers (its rollout key)."""
        return {"Authorization": f"Bearer {self.keys[rollout_id]}"}

    async def chat(self, rollout_id: str, body: dict[str, Any]) -> httpx.Response:
        return await self.control.post(
            f"/v1/rollouts/{rollout_id}/chat/completions",
            json={"model": "agent", **body},
            headers=self.agent(rollout_id),
        )

    async def trajectory(self, rollout_id: str) -> dict[str, Any]:
        r = await self.control.get(f"/v1/rollouts/{rollout_id}/trajectory")
        assert r.status_code == 200, r.text
        return r.json()

    async def tokenize(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        """The engine's own rendering of ``messages`` (vLLM ``POST /tokenize``)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            body["tools"] = tools
        root = self.engine_url.removesuffix("/v1")
        r = await self.engine.post(f"{root}/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]


@contextlib.asynccontextmanager
async def real_gateway(**fields: Any) -> AsyncIterator[RealGateway]:
    """A fresh gateway in front of the real vLLM (``fields``: more ``GatewayConfig``)."""
    url = os.environ[URL_VAR].rstrip("/")
    async with httpx.AsyncClient(timeout=300) as engine:
        model = os.environ.get(MODEL_VAR)
        if not model:
            model = (await engine.get(f"{url}/models")).json()["data"][0]["id"]
        config = GatewayConfig.from_fields(
            upstreams=[url], admin_token=ADMIN, stream_keepalive_s=1.0, **fields
        )
        async with contextlib.AsyncExitStack() as stack:
            root = await stack.enter_async_context(running_server(create_app(config)))
            control = await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=root, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300
                )
            )
            yield RealGateway(url, model, control, engine)


@pytest.fixture
async def real() -> AsyncIterator[RealGateway]:
    """A fresh gateway in front of the real vLLM."""
    async with real_gateway() as gateway:
        yield gateway


class Stopwatch:
    """Seconds since creation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start
