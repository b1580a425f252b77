"""httpx requests to an ASGI app in this process, its answer streamed as the app sends it.

httpx's own ``ASGITransport`` waits for the whole answer before it returns: a response
that does not end (the gateway's exit stream) never returns. :class:`StreamingASGITransport`
runs the app in a task of its own and hands the response over at its first message, its
body chunk by chunk; closing the response (or its reader going away) tells the app the
client disconnected, as a closed connection would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

#: What the app's task puts in the body queue when its answer is complete.
_END = b""


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """An httpx transport to ``app`` (an ASGI callable) in this process, streaming."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Run the app on ``request``; the response once its head is sent."""
        body = b"".join([chunk async for chunk in request.stream])  # type: ignore[union-attr]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for (k, v) in request.headers.raw],
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "server": (request.url.host, request.url.port),
            "client": ("127.0.0.1", 123),
            "root_path": "",
        }
        exchange = _Exchange(body)
        task = asyncio.ensure_future(self.app(scope, exchange.receive, exchange.send))
        task.add_done_callback(exchange.app_done)
        head = await exchange.head
        headers = [(bytes(k), bytes(v)) for k, v in head.get("headers", [])]
        return httpx.Response(head["status"], headers=headers, stream=_Body(exchange, task))


class _Exchange:
    """One request's ASGI channel: its body in, the response's messages out."""

    def __init__(self, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.chunks: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        self.closed = asyncio.Event()
        self._body: bytes | None = body

    async def receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.closed.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.head.set_result(message)
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.put_nowait(bytes(message["body"]))
            if not message.get("more_body", False):
                self.chunks.put_nowait(_END)

    def app_done(self, task: asyncio.Future[Any]) -> None:
        failure = None if task.cancelled() else task.exception()
        if not self.head.done():  # no answer at all: the app failed (a server's 500)
            if failure is not None:
                self.head.set_exception(failure)
            else:
                self.head.set_result({"status": 500, "headers": []})
            return
        if failure is not None:
            self.chunks.put_nowait(httpx.ReadError(f"the app failed mid-answer: {failure!r}"))
        self.chunks.put_nowait(_END)  # (after a complete answer: never read)


class _Body(httpx.AsyncByteStream):
    """A response body read off the app's task as it sends it."""

    def __init__(self, exchange: _Exchange, task: asyncio.Future[Any]) -> None:
        self._exchange = exchange
        self._task = task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self._exchange.chunks.get()
            if isinstance(chunk, BaseException):
                raise chunk
            if chunk == _END:
                return
            yield chunk

    def fail(self, error: BaseException) -> None:
        """Make the next read raise ``error`` (a connection that broke)."""
        self._exchange.chunks.put_nowait(error)

    async def aclose(self) -> None:
        """The client is done with the response: the app hears a disconnect."""
        self._exchange.closed.set()
        if not self._task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), 1.0)
        if not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


__all__ = ["StreamingASGITransport"]
