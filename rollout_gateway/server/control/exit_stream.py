"""The gateway's exit stream: ``GET /v1/rollouts/exits?after=<seq>&stream=1``.

One held connection per env (control plane, admin token) instead of a long-poll per
batch of exits: the gateway writes each agent's exit report as a line the moment it
arrives (:meth:`rollout_gateway.exits.ExitBoard.follow` makes the lines; the protocol is
in :mod:`rollout_gateway.protocol`, ``EXIT_STREAM_*``). Bounded:

- at most ``max_streams`` streams at once; more are refused with 429
  (``too_many_exit_streams``), and the env long-polls meanwhile;
- a client that goes away frees its stream at once (a watcher of the connection's
  ``http.disconnect``, one task per stream, not per waiting rollout); uvicorn drops
  writes to a closed connection silently, so without it a stream would live on;
- :meth:`ExitStreams.close` (the server's shutdown, see ``server.runner``) ends every
  stream cleanly, so a shutdown does not wait for streams that never end by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.responses import Response

from rollout_gateway import protocol
from rollout_gateway.exits import ExitBoard
from rollout_gateway.interrupt import Interrupt
from rollout_gateway.server.config import DEFAULT_MAX_EXIT_STREAMS
from rollout_gateway.server.http.responses import ApiError, until_disconnect


class ExitStreams:
    """The open exit streams of one gateway: counted, capped, ended on shutdown.

    Args:
        board: the gateway's exit reports.
        max_streams: streams served at once.
        keepalive: seconds without a report before a heartbeat line.
    """

    def __init__(
        self,
        board: ExitBoard,
        *,
        max_streams: int = DEFAULT_MAX_EXIT_STREAMS,
        keepalive: float = protocol.EXIT_STREAM_KEEPALIVE,
    ) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        self.board = board
        self.max_streams = max_streams
        self.keepalive = keepalive
        #: Streams open now.
        self.open = 0
        #: Whether :meth:`close` was called (new streams are refused with 503).
        self.closed = False

    def response(self, after: int) -> Response:
        """The streamed answer from cursor ``after``; :class:`ApiError` when refused."""
        if self.closed:
            raise ApiError(503, "the gateway is shutting down", "service_unavailable")
        if self.open >= self.max_streams:
            raise ApiError(
                429,
                f"too many exit streams (at most {self.max_streams}); long-poll instead",
                "rate_limit_error",
                code="too_many_exit_streams",
            )
        self.open += 1  # released when the answer ends (see ExitStreamResponse)
        return ExitStreamResponse(self, after)

    def close(self) -> None:
        """End every stream (after the lines already due) and refuse new ones."""
        self.closed = True
        self.board.wake()


class ExitStreamResponse(Response):
    """One exit stream as an ASGI answer (made by :meth:`ExitStreams.response`)."""

    media_type = protocol.EXIT_STREAM_MEDIA_TYPE

    def __init__(self, streams: ExitStreams, after: int) -> None:
        self.streams = streams
        self.after = after
        self.status_code = 200
        self.background = None
        # No caching, and no buffering by a proxy (nginx honours X-Accel-Buffering).
        self.init_headers({"cache-control": "no-store", "x-accel-buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        streams = self.streams
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        listener = asyncio.ensure_future(_until_disconnect(receive, gone))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            lines = streams.board.follow(
                self.after, keepalive=streams.keepalive, closed=lambda: streams.closed
            )
            async with Interrupt(gone), contextlib.aclosing(lines):
                async for chunk in lines:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not gone.done():  # ended by close(): the client sees a clean end
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            streams.open -= 1
            listener.cancel()


async def _until_disconnect(receive: Any, gone: asyncio.Future[None]) -> None:
    """Resolve ``gone`` when the client disconnects (the request body is read first)."""
    await until_disconnect(receive)
    if not gone.done():
        gone.set_result(None)


__all__ = ["ExitStreamResponse", "ExitStreams"]
