"""The reference gateway's exit stream, on a real server: one connection, bounded, clean end."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient
from rollout_gateway.errors import GatewayUnavailableError
from rollout_gateway.exits import ExitWatcher
from rollout_gateway.server import GatewayConfig, create_app, running_server

ADMIN = "adm"


def _config(**options: object) -> GatewayConfig:
    return GatewayConfig.from_fields(
        upstreams=["http://127.0.0.1:9/v1"],
        require_rollout_keys=True,
        admin_token=ADMIN,
        **options,  # type: ignore[arg-type]
    )


class CountingTransport(httpx.AsyncBaseTransport):
    """A real HTTP transport that counts the requests per path."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.paths: Counter[str] = Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths[request.url.path] += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    """Wait (a real server runs in this loop) until ``predicate()``."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def _rest(lines: Any) -> list[Any]:
    return [line async for line in lines]


async def _register(client: GatewayClient, n: int) -> list[tuple[str, str]]:
    rollouts = []
    for _ in range(n):
        rollout_id = protocol.new_rollout_id()
        answer = await client.register(
            rollout_id, model="m", api_key=protocol.new_rollout_api_key()
        )
        rollouts.append((rollout_id, answer["api_key"]))
    return rollouts


async def test_a_burst_of_exits_comes_over_one_connection():
    app = create_app(_config())
    transport = CountingTransport()
    async with running_server(app) as root:
        async with GatewayClient(root, admin_token=ADMIN, transport=transport) as client:
            rollouts = await _register(client, 30)
            watcher = ExitWatcher(client)
            hints = [watcher.subscribe(rollout_id) for rollout_id, _ in rollouts]
            await _until(lambda: app.state.gateway.exit_streams.open == 1)
            async with httpx.AsyncClient(base_url=root) as agents:
                # The agents' launch wrappers report their exits, all at once.
                answers = await asyncio.gather(
                    *(
                        agents.post(
                            protocol.exit_path(rollout_id),
                            json={"exit_code": i},
                            headers={"Authorization": f"Bearer {key}"},
                        )
                        for i, (rollout_id, key) in enumerate(rollouts)
                    )
                )
            assert {a.status_code for a in answers} == {200}
            assert await asyncio.wait_for(asyncio.gather(*hints), 5) == list(range(30))
            assert watcher.streaming is True
            await watcher.aclose()
            await _until(lambda: app.state.gateway.exit_streams.open == 0)
    assert transport.paths[protocol.EXITS_PATH] == 1


async def test_the_stream_is_control_plane_only():
    async with running_server(create_app(_config())) as root:
        async with GatewayClient(root, admin_token=ADMIN) as client:
            [(_, key)] = await _register(client, 1)
        query = protocol.exits_query(0, stream=True)
        async with httpx.AsyncClient(base_url=root) as http:
            for headers in ({}, {"Authorization": f"Bearer {key}"}):  # none; a rollout's key
                refused = await http.get(protocol.EXITS_PATH, params=query, headers=headers)
                assert refused.status_code == 401
                assert "application/json" in refused.headers["content-type"]


async def test_streams_are_capped_and_a_disconnect_frees_one_at_once():
    app = create_app(_config(max_exit_streams=1))  # serve --max-exit-streams 1
    streams = app.state.gateway.exit_streams
    async with running_server(app) as root:
        async with GatewayClient(root, admin_token=ADMIN) as client:
            async with client.exit_feed(0) as feed:
                assert feed.streamed
                assert await anext(aiter(feed)) == {"cursor": 0}
                with pytest.raises(GatewayUnavailableError) as refused:
                    async with client.exit_feed(0):
                        pass
                assert refused.value.status_code == 429 and streams.open == 1
            # The client went away between heartbeats (10 s apart): freed at once.
            await _until(lambda: streams.open == 0, timeout=2)
            assert app.state.gateway.exit_board.waiting == 0  # nothing left waiting
            async with client.exit_feed(0) as feed:
                assert await anext(aiter(feed)) == {"cursor": 0}


async def test_a_refused_stream_is_long_polled_by_the_watcher():
    app = create_app(_config(max_exit_streams=1))
    async with running_server(app) as root:
        async with GatewayClient(root, admin_token=ADMIN) as client:
            [(rollout_id, key)] = await _register(client, 1)
            async with client.exit_feed(0):  # another env holds the only stream
                watcher = ExitWatcher(client)
                hint = watcher.subscribe(rollout_id)
                await _until(lambda: watcher.supported is True)
                async with httpx.AsyncClient(base_url=root) as agent:
                    await agent.post(
                        protocol.exit_path(rollout_id),
                        json={"exit_code": 4},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                assert await asyncio.wait_for(hint, 5) == 4
                await watcher.aclose()


async def test_shutdown_ends_an_open_stream_and_long_poll_cleanly():
    app = create_app(_config())
    server = running_server(app)
    root = await server.__aenter__()
    stopped = None
    try:
        async with GatewayClient(root, admin_token=ADMIN) as client:
            long_poll = asyncio.ensure_future(client.wait_exits(0, 30))
            async with client.exit_feed(0) as feed:
                lines = aiter(feed)
                assert await anext(lines) == {"cursor": 0}
                await _until(lambda: app.state.gateway.exit_board.waiting == 2)
                stopped = asyncio.ensure_future(server.__aexit__(None, None, None))
                rest = await asyncio.wait_for(_rest(lines), 5)  # ends without an error
            assert rest == []
            # The long-poll is answered at once, not after its 30 s.
            assert await asyncio.wait_for(long_poll, 5) == {"exits": [], "cursor": 0}
        await asyncio.wait_for(stopped, 5)  # uvicorn did not wait for either
    finally:
        if stopped is None:
            await server.__aexit__(None, None, None)
    assert app.state.gateway.exit_streams.open == 0


async def test_heartbeats_keep_a_quiet_stream_alive():
    app = create_app(_config())
    app.state.gateway.exit_streams.keepalive = 0.05
    async with running_server(app) as root:
        async with GatewayClient(root, admin_token=ADMIN) as client:
            async with client.exit_feed(0, idle_timeout=1.0) as feed:
                lines = aiter(feed)
                # The opening heartbeat, then one per quiet keepalive period.
                assert [await anext(lines) for _ in range(3)] == [{"cursor": 0}] * 3


async def test_a_silent_stream_is_noticed_as_dead():
    """A connection that stops carrying heartbeats (a dead peer) fails the read."""

    async def silent(request: Request) -> Response:
        async def body() -> Any:
            yield protocol.exit_stream_line({"cursor": 0})
            await asyncio.Event().wait()  # never another line

        return StreamingResponse(body(), media_type=protocol.EXIT_STREAM_MEDIA_TYPE)

    app = Starlette(routes=[Route(protocol.EXITS_PATH, silent)])
    async with running_server(app) as root:
        async with GatewayClient(root) as client:
            with pytest.raises(GatewayUnavailableError, match="ReadTimeout"):
                async with client.exit_feed(0, idle_timeout=0.2) as feed:
                    async for _ in feed:
                        pass
