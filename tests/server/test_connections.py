"""Header/body timeouts and the connection cap on a live server (small configured limits)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from rollout_gateway.server import GatewayConfig, create_app, running_server

ADMIN = "connections-admin-token-01"


@contextlib.asynccontextmanager
async def gateway(**limits: float) -> AsyncIterator[tuple[str, int]]:
    config = GatewayConfig(upstreams=["http://127.0.0.1:9/v1"], admin_token=ADMIN, **limits)
    async with running_server(create_app(config)) as root:
        yield root, int(root.rsplit(":", 1)[1])


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection (EOF) within ``seconds``."""
    try:
        while await asyncio.wait_for(reader.read(1024), seconds):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def test_silent_connection_is_closed_by_the_header_timeout() -> None:
    async with gateway(header_timeout_s=0.2) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_within(reader, 5)
        writer.close()


async def test_dripped_headers_are_closed_by_the_header_timeout() -> None:
    async with gateway(header_timeout_s=0.3) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes
        await writer.drain()
        assert await closed_within(reader, 5)
        writer.close()


async def test_slow_body_is_closed_by_the_body_timeout() -> None:
    async with gateway(body_timeout_s=0.3) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/rollouts/r1/register HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
        )
        await writer.drain()
        assert await closed_within(reader, 5)
        writer.close()


async def test_connection_cap_refuses_extra_connections_and_recovers() -> None:
    async with gateway(max_connections=3, header_timeout_s=30) as (root, port):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_within(reader, 5)  # closed at once, not queued
        writer.close()
        for _, w in held:
            w.close()
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{root}/health")).status_code == 200


async def test_keep_alive_connection_serves_requests_normally() -> None:
    async with gateway(header_timeout_s=0.5, body_timeout_s=0.5) as (root, _):
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                assert (await client.get(f"{root}/health")).status_code == 200
                await asyncio.sleep(0.2)
