"""The upstream client over real loopback sockets, on both of its paths.

Every other server test reaches its fake engine through an injected in-process httpx
transport; here the engine listens on a port, so each path's own pool, parser and errors
are exercised: the lean HTTP/1.1 connections (``lean``: every chat call in production) and
httpx's (``httpx``: GETs, other origins, and every call when a transport is injected, here
httpx's own network transport): whole and streamed turns, an unreachable upstream, a
stalled answer (one classification, ``timeout``, for the whole and the streamed call).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.server.engines.upstream_http import line_spans, split_lines
from rollout_gateway.server.engines.upstream_http1 import (
    Http1ConnectError,
    Http1TransportError,
    Http1Upstream,
)

from .test_true_streaming import ReplayVLLM

ADMIN = "test-admin-token-0123456789"
CLIENTS = ["lean", "httpx"]


@contextlib.asynccontextmanager
async def gateway_before(
    upstream_url: str, client: str, **config: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway on loopback in front of ``upstream_url``, its chat calls on the ``client``
    path; an admin client to it."""
    transport = httpx.AsyncHTTPTransport() if client == "httpx" else None
    app = create_app(
        GatewayConfig.from_fields(upstreams=[upstream_url], admin_token=ADMIN, **config),
        upstream_transport=transport,
    )
    async with (
        running_server(app) as root,
        httpx.AsyncClient(
            base_url=root, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
        ) as admin,
    ):
        yield admin


async def register(admin: httpx.AsyncClient, rollout_id: str = "r1") -> dict[str, str]:
    r = await admin.post(f"/v1/rollouts/{rollout_id}/register", json={"model": "gemma3-270m"})
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


def sse_payloads(raw: str) -> list[dict[str, Any]]:
    return [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]


@pytest.mark.parametrize("client", CLIENTS)
async def test_whole_and_streamed_turns_record_the_engine_tokens(client: str) -> None:
    engine = ReplayVLLM("text")
    whole = engine.answer["choices"][0]
    messages = engine.request["messages"]
    url = "/v1/rollouts/r1/chat/completions"
    async with (
        running_server(engine.app()) as engine_root,
        gateway_before(f"{engine_root}/v1", client) as admin,
    ):
        agent = await register(admin)
        r = await admin.post(url, json={"model": "a", "messages": messages}, headers=agent)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == whole["message"]["content"]
        body = {"model": "a", "messages": messages, "stream": True}
        async with admin.stream("POST", url, json=body, headers=agent) as s:
            raw = (await s.aread()).decode()
        traj = (await admin.get("/v1/rollouts/r1/trajectory")).json()
    text = "".join(c["delta"].get("content") or "" for p in sse_payloads(raw) for c in p["choices"])
    assert text == whole["message"]["content"] and raw.rstrip().endswith("data: [DONE]")
    assert [b.get("stream", False) for b in engine.bodies] == [False, True]
    assert traj["num_turns"] == 2
    for step in traj["trajectory"]:
        assert step["tokens"]["prompt_ids"] == engine.answer["prompt_token_ids"]
        assert step["tokens"]["completion_ids"] == whole["token_ids"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nobody listens


@pytest.mark.parametrize("client", CLIENTS)
async def test_an_unreachable_upstream_is_a_connect_failure(client: str) -> None:
    upstream = f"http://127.0.0.1:{_closed_port()}/v1"
    async with gateway_before(upstream, client) as admin:
        agent = await register(admin)
        r = await admin.post(
            "/v1/rollouts/r1/chat/completions",
            json={"model": "a", "messages": [{"role": "user", "content": "hi"}]},
            headers=agent,
        )
        health = (await admin.get("/health")).json()
        metrics = (await admin.get("/metrics")).text
    assert r.status_code == 502
    assert r.json()["error"]["message"] == "upstream unreachable"
    assert "127.0.0.1" not in r.text  # no upstream detail for the agent
    assert health["upstreams"][0]["healthy"] is False
    assert 'kind="connect"} 1' in metrics


class StallingEngine:
    """A vLLM-shaped engine whose answers start and then stall (headers and a first
    piece sent, the rest never): whole answers mid-body, streams after one chunk."""

    def __init__(self) -> None:
        self.replay = ReplayVLLM("text")
        self.release = asyncio.Event()

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            if body.get("stream"):
                first = self.replay.raw.split("\n\n")[0] + "\n\n"
            else:
                first = json.dumps(self.replay.answer)[:20]

            async def pieces() -> AsyncIterator[bytes]:
                yield first.encode()
                await self.release.wait()

            media = "text/event-stream" if body.get("stream") else "application/json"
            return StreamingResponse(pieces(), media_type=media)

        async def models(request: Request) -> Response:
            card = {"id": "gemma3-270m", "owned_by": "vllm", "max_model_len": 4096}
            return JSONResponse({"object": "list", "data": [card]})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_stalled_answer_is_a_timeout_whole_or_streamed(client: str) -> None:
    engine = StallingEngine()
    url = "/v1/rollouts/r1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    try:
        async with (
            running_server(engine.app()) as engine_root,
            gateway_before(f"{engine_root}/v1", client, upstream_timeout_s=0.3) as admin,
        ):
            agent = await register(admin)
            plain = await admin.post(url, json={"model": "a", "messages": messages}, headers=agent)
            body = {"model": "a", "messages": messages, "stream": True}
            async with admin.stream("POST", url, json=body, headers=agent) as s:
                raw = (await s.aread()).decode()
            metrics = (await admin.get("/metrics")).text
            health = (await admin.get("/health")).json()
    finally:
        engine.release.set()
    assert plain.status_code == 502
    assert plain.json()["error"]["message"] == "upstream timed out"
    assert "upstream timed out" in sse_payloads(raw)[-1]["error"]["message"]
    assert 'kind="timeout"} 2' in metrics  # one classification for both paths
    assert health["upstreams"][0]["healthy"] is True  # it answered: reachable, only slow


def test_failure_kinds_are_one_classification_for_both_paths() -> None:
    client = Http1Upstream("http://engine/v1")
    assert client.failure_kind(Http1ConnectError("refused")) == "connect"
    assert client.failure_kind(Http1TransportError("cut")) == "transport"
    assert client.failure_kind(TimeoutError()) == "timeout"  # the total deadline
    assert client.failure_kind(httpx.ConnectError("refused")) == "connect"
    assert client.failure_kind(httpx.ConnectTimeout("slow")) == "connect"
    assert client.failure_kind(httpx.ReadTimeout("slow")) == "timeout"  # a read timeout
    assert client.failure_kind(httpx.RemoteProtocolError("cut")) == "transport"
    assert client.failure_kind(ValueError()) is None


async def test_split_lines_handles_any_chunking_and_long_lines() -> None:
    long_line = "data: " + "7," * 200_000  # a 32k-token prompt's ids come as one SSE line

    async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    short = b"a\r\n\nb\nlast"
    assert [x async for x in split_lines(chunks(short, 1))] == ["a", "", "b", "last"]
    text = f"a\r\n\n{long_line}\nlast\n".encode()
    for size in (7, 4096, len(text)):
        assert [x async for x in split_lines(chunks(text, size))] == ["a", "", long_line, "last"]


async def test_line_spans_find_lines_in_the_bytes_without_copying_them_out() -> None:
    # The lines of any chunking, CR LF or LF, are the spans of the buffers they came in
    # (a line within one chunk is that chunk's bytes; one longer than a read joined once).
    long_line = b"data: " + b"7," * 100_000

    async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    text = b"a\r\n\n" + long_line + b"\r\nlast\r"
    for size in (1, 5, 4096, len(text)):
        spans = [span async for span in line_spans(chunks(text, size))]
        assert [b[start:stop] for b, start, stop in spans] == [b"a", b"", long_line, b"last"]
    whole = b"data: {}\n\n"
    ((buffer, start, stop), blank) = [span async for span in line_spans(chunks(whole, 99))]
    assert buffer is whole and (start, stop) == (0, 8) and blank[1:] == (9, 9)
