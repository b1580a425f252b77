"""What the gateway's upstream client answers, and the httpx calls behind it.

Everything the gateway asks of an upstream over HTTP goes through one client,
:class:`~.upstream_http1.Http1Upstream`: ``post`` (a whole chat completion), ``stream`` (a
streamed one, read line by line) and ``get`` (``/models``, vLLM's ``/server_info``). Its
chat POSTs run on lean HTTP/1.1 connections; the rest goes through :class:`HttpxCalls`
here, httpx's client, which also takes the transport a test injects (every call then goes
through it, to an in-process fake engine).

Failures are classified once for every call path (``failure_kind``): ``connect``
(unreachable, connect timeout), ``timeout`` (any other timeout, including a read timeout
and the caller's total deadline) or ``transport`` (the connection broke).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx

#: How a call that got no answer failed (see the module docstring).
ConnectionFailureKind = Literal["connect", "timeout", "transport"]


# Not frozen: made every turn, and a frozen dataclass's constructor costs several
# times a plain one's (issue 33).
@dataclass(slots=True)
class HTTPAnswer:
    """An upstream's whole answer."""

    status_code: int
    content: bytes
    reason: str = ""

    @property
    def text(self) -> str:
        """The body as text (invalid UTF-8 replaced)."""
        return self.content.decode("utf-8", "replace")


class UpstreamStream(Protocol):
    """An answer being streamed."""

    status_code: int

    async def read(self) -> HTTPAnswer:
        """The rest of the body, whole (error answers)."""
        ...

    def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line ends."""
        ...


def _join(base_url: str, url: str) -> str:
    return url if "://" in url else base_url.rstrip("/") + "/" + url.lstrip("/")


async def split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a byte stream, without ``\n`` / ``\r\n``, of any length (vLLM's first
    chunk carries the whole prompt's ids on one line). Each line is found with ``find``
    (memchr) and decoded straight out of the buffer: no split into a list of copies."""
    parts: list[bytes] = []
    async for chunk in chunks:
        if b"\n" not in chunk:
            parts.append(chunk)
            continue  # a line longer than the chunk: joined once it ends
        if parts:
            parts.append(chunk)
            chunk, parts = b"".join(parts), []
        view, start = memoryview(chunk), 0
        end = chunk.find(b"\n")
        while end >= 0:
            stop = end - 1 if end > start and chunk[end - 1] == 13 else end  # 13: "\r"
            yield str(view[start:stop], "utf-8", "replace")
            start = end + 1
            end = chunk.find(b"\n", start)
        if start < len(chunk):
            parts = [chunk[start:]]
    if parts:
        yield b"".join(parts).removesuffix(b"\r").decode("utf-8", "replace")


# -- httpx -----------------------------------------------------------------------------------


class _HttpxStream:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code

    async def read(self) -> HTTPAnswer:
        content = await self._response.aread()
        return HTTPAnswer(self._response.status_code, content, self._response.reason_phrase)

    def lines(self) -> AsyncIterator[str]:
        return self._response.aiter_lines()


class HttpxCalls:
    """The upstream calls that go through httpx: GETs, POSTs to another origin than the
    base URL's, and every call when a test injects ``transport``.

    Args:
        base_url: the upstream's OpenAI base URL.
        transport: an httpx transport (tests: an in-process fake engine).
        headers: sent with every request (the upstream's API key).
        connect_timeout_s: connect timeout (a dead upstream fails fast).
        max_connections: connection pool size.
        ssl_context: TLS settings for ``https`` URLs (default: the system's trust store).
    """

    def __init__(
        self,
        base_url: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=30.0,
        )
        # The total deadline is the caller's (asyncio.timeout): no per-phase read timeout.
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=limits,
            headers=dict(headers or {}),
            transport=transport,
            verify=ssl_context if ssl_context is not None else True,
        )

    async def post(self, path: str, content: bytes) -> HTTPAnswer:
        """POST JSON ``content`` to ``path`` (under the base URL, or absolute)."""
        response = await self.client.post(
            _join(self.base_url, path), content=content, headers=_JSON
        )
        return HTTPAnswer(response.status_code, response.content, response.reason_phrase)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, content: bytes) -> AsyncIterator[UpstreamStream]:
        """POST JSON ``content``; the answer streamed (closed when the context exits)."""
        client = self.client
        request = client.build_request(
            "POST", _join(self.base_url, path), content=content, headers=_JSON
        )
        response = await client.send(request, stream=True)
        try:
            yield _HttpxStream(response)
        finally:
            # Shielded: closing the stream is what tells the engine to stop.
            await asyncio.shield(response.aclose())

    async def get(
        self, url: str, *, timeout_s: float, params: Mapping[str, str] | None = None
    ) -> HTTPAnswer:
        """GET ``url`` (absolute, or a path under the base URL) within ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            response = await self.client.get(_join(self.base_url, url), params=dict(params or {}))
        return HTTPAnswer(response.status_code, response.content, response.reason_phrase)

    @staticmethod
    def failure_kind(exc: BaseException) -> ConnectionFailureKind | None:
        """How ``exc`` raised by a call failed (``None``: not a connection failure)."""
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return "connect"
        if isinstance(exc, httpx.TimeoutException | TimeoutError):
            return "timeout"
        if isinstance(exc, httpx.HTTPError):
            return "transport"
        return None

    async def aclose(self) -> None:
        """Close every connection."""
        await self.client.aclose()


_JSON = {"Content-Type": "application/json"}


__all__ = [
    "ConnectionFailureKind",
    "HTTPAnswer",
    "HttpxCalls",
    "UpstreamStream",
    "split_lines",
]
