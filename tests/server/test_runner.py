"""The in-process uvicorn runner: an idle server does not poll, and exits at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from rollout_gateway.server.runner import running_server, server_thread

#: A housekeeping pass an hour apart: only the exit request itself can end the wait.
HOUR = 3600.0


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_an_exit_request_ends_the_server_at_once_not_at_its_next_pass() -> None:
    async def serve_once() -> None:
        async with running_server(ok_app, tick_s=HOUR) as root:
            async with httpx.AsyncClient() as client:
                assert (await client.get(root)).text == "ok"

    await asyncio.wait_for(serve_once(), 20)  # an hour-long pass would time this out


def test_a_server_in_a_thread_stops_at_once_when_asked_from_another_thread() -> None:
    started = time.monotonic()
    with server_thread(ok_app, tick_s=HOUR) as root:
        assert httpx.get(root).text == "ok"
    # server_thread waits up to 30 s for its thread; an hour-long pass would use them all.
    assert time.monotonic() - started < 20
