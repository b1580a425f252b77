"""The HTTP client of one upstream: the seam between the gateway and an HTTP library.

Everything the gateway asks of an upstream over HTTP goes through :class:`UpstreamHTTP`:
``post`` (a whole chat completion), ``stream`` (a streamed one, read line by line) and
``get`` (``/models``, vLLM's ``/server_info``). Two implementations here, and a third,
the default, in :mod:`.upstream_http1` (``Http1Upstream``: the chat POST, whole or
streamed, on lean HTTP/1.1 connections over httptools, every other call through
:class:`AiohttpUpstream`):

* :class:`AiohttpUpstream`: aiohttp's client, whose C HTTP parser and
  connection pool cost a third of httpx's CPU per turn on this gateway
  (``benchmarks/gateway_overhead.py``; the upstream client was the largest share of a
  turn's CPU). One pool per upstream; connections are reused most-recent first, so a
  rollout that runs alone keeps one warm connection.
* :class:`HttpxUpstream`: httpx, whose transports tests inject (``upstream_transport``)
  to reach in-process fake engines. Its pool is split in a few shards (httpcore's pool
  bookkeeping is O(connections^2) per request).

Failures are classified once, here, for every call path (:meth:`UpstreamHTTP.failure_kind`):
``connect`` (unreachable, connect timeout), ``timeout`` (any other timeout, including a
read timeout and the caller's total deadline) or ``transport`` (the connection broke).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

#: How a call that got no answer failed (see the module docstring).
ConnectionFailureKind = Literal["connect", "timeout", "transport"]


@dataclass(frozen=True)
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


class UpstreamHTTP(Protocol):
    """The HTTP client of one upstream (``base_url`` is its OpenAI base URL)."""

    base_url: str

    async def post(self, path: str, content: bytes, *, key: str | None = None) -> HTTPAnswer:
        """POST JSON ``content`` to ``base_url + path`` (or to ``path`` when it is an
        absolute URL, e.g. vLLM's root-level token-in endpoint); the whole answer. ``key``
        (a rollout id) keeps one rollout's calls on one connection where that matters."""
        ...

    def stream(
        self, path: str, content: bytes, *, key: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[UpstreamStream]:
        """POST JSON ``content``; the answer streamed (closed, and the engine told to
        stop, when the context exits)."""
        ...

    async def get(
        self, url: str, *, timeout_s: float, params: Mapping[str, str] | None = None
    ) -> HTTPAnswer:
        """GET ``url`` (absolute, or a path under ``base_url``) within ``timeout_s``."""
        ...

    def failure_kind(self, exc: BaseException) -> ConnectionFailureKind | None:
        """How ``exc`` raised by a call failed (``None``: not a connection failure)."""
        ...

    async def aclose(self) -> None:
        """Close every connection."""
        ...


def _join(base_url: str, url: str) -> str:
    return url if "://" in url else base_url.rstrip("/") + "/" + url.lstrip("/")


async def split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a byte stream, without ``\n`` / ``\r\n``, of any length (vLLM's first
    chunk carries the whole prompt's ids on one line)."""
    parts: list[bytes] = []
    async for chunk in chunks:
        parts.append(chunk)
        if b"\n" not in chunk:
            continue  # a line longer than the chunk: joined once it ends
        *lines, rest = b"".join(parts).split(b"\n")
        parts = [rest] if rest else []
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", "replace")
    if parts:
        yield b"".join(parts).removesuffix(b"\r").decode("utf-8", "replace")


# -- aiohttp ---------------------------------------------------------------------------------


class _AiohttpStream:
    def __init__(self, response: Any) -> None:
        self._response = response
        self.status_code: int = response.status

    async def read(self) -> HTTPAnswer:
        return HTTPAnswer(self._response.status, await self._response.read(), self._reason)

    @property
    def _reason(self) -> str:
        return str(self._response.reason or "")

    def lines(self) -> AsyncIterator[str]:
        return split_lines(self._response.content.iter_any())


class AiohttpUpstream:
    """:class:`UpstreamHTTP` over one ``aiohttp.ClientSession`` (see the module docstring).

    Args:
        base_url: the upstream's OpenAI base URL.
        headers: sent with every request (the upstream's API key).
        connect_timeout_s: connect timeout (a dead upstream fails fast).
        max_connections: connection pool size.
        keepalive_s: idle connections are closed after this.
        ssl_context: TLS settings for ``https`` URLs (default: the system's trust store).
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        keepalive_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {**(headers or {}), "Content-Type": "application/json"}
        self._get_headers = dict(headers or {})
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._ssl_context = ssl_context
        self._session: Any = None

    def _client(self) -> Any:
        # Created on first use: an aiohttp session belongs to the running event loop.
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=self._keepalive_s,
                ssl=self._ssl_context if self._ssl_context is not None else True,
            )
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                auto_decompress=True,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def post(self, path: str, content: bytes, *, key: str | None = None) -> HTTPAnswer:
        """See :meth:`UpstreamHTTP.post`."""
        async with self._client().post(
            _join(self.base_url, path), data=content, headers=self._headers
        ) as response:
            return HTTPAnswer(response.status, await response.read(), str(response.reason or ""))

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, content: bytes, *, key: str | None = None
    ) -> AsyncIterator[UpstreamStream]:
        """See :meth:`UpstreamHTTP.stream`."""
        async with self._client().post(
            self.base_url + path, data=content, headers=self._headers
        ) as response:
            yield _AiohttpStream(response)

    async def get(
        self, url: str, *, timeout_s: float, params: Mapping[str, str] | None = None
    ) -> HTTPAnswer:
        """See :meth:`UpstreamHTTP.get`."""
        async with asyncio.timeout(timeout_s):
            async with self._client().get(
                _join(self.base_url, url), params=params, headers=self._get_headers
            ) as response:
                return HTTPAnswer(
                    response.status, await response.read(), str(response.reason or "")
                )

    def failure_kind(self, exc: BaseException) -> ConnectionFailureKind | None:
        """See :meth:`UpstreamHTTP.failure_kind`."""
        import aiohttp

        if isinstance(exc, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError):
            return "connect"
        if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
            return "timeout"
        if isinstance(exc, aiohttp.ClientError):
            return "transport"
        return None

    async def aclose(self) -> None:
        """See :meth:`UpstreamHTTP.aclose`."""
        if self._session is not None:
            await self._session.close()
            self._session = None


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


class HttpxUpstream:
    """:class:`UpstreamHTTP` over ``httpx.AsyncClient`` shards (see the module docstring).

    Args:
        base_url: the upstream's OpenAI base URL.
        transport: an httpx transport (tests: an in-process fake engine).
        headers: sent with every request (the upstream's API key).
        connect_timeout_s: connect timeout (a dead upstream fails fast).
        max_connections: connection pool size (all shards together).
        shards: number of clients; one rollout's calls stay on one.
    """

    def __init__(
        self,
        base_url: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        shards: int = 16,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        per_shard = max(1, -(-max_connections // shards))
        limits = httpx.Limits(
            max_connections=per_shard, max_keepalive_connections=per_shard, keepalive_expiry=30.0
        )
        # The total deadline is the caller's (asyncio.timeout): no per-phase read timeout.
        timeout = httpx.Timeout(None, connect=connect_timeout_s)
        self.clients = [
            httpx.AsyncClient(
                base_url=self.base_url,
                timeout=timeout,
                limits=limits,
                headers=dict(headers or {}),
                transport=transport,
            )
            for _ in range(shards)
        ]
        self._next = 0

    def _client(self, key: str | None) -> httpx.AsyncClient:
        if key is not None:
            return self.clients[hash(key) % len(self.clients)]
        self._next = (self._next + 1) % len(self.clients)
        return self.clients[self._next]

    async def post(self, path: str, content: bytes, *, key: str | None = None) -> HTTPAnswer:
        """See :meth:`UpstreamHTTP.post`."""
        response = await self._client(key).post(
            path, content=content, headers={"Content-Type": "application/json"}
        )
        return HTTPAnswer(response.status_code, response.content, response.reason_phrase)

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, content: bytes, *, key: str | None = None
    ) -> AsyncIterator[UpstreamStream]:
        """See :meth:`UpstreamHTTP.stream`."""
        client = self._client(key)
        request = client.build_request(
            "POST", path, content=content, headers={"Content-Type": "application/json"}
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
        """See :meth:`UpstreamHTTP.get`."""
        async with asyncio.timeout(timeout_s):
            response = await self._client(None).get(
                _join(self.base_url, url), params=dict(params or {})
            )
        return HTTPAnswer(response.status_code, response.content, response.reason_phrase)

    def failure_kind(self, exc: BaseException) -> ConnectionFailureKind | None:
        """See :meth:`UpstreamHTTP.failure_kind`."""
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return "connect"
        if isinstance(exc, httpx.TimeoutException | TimeoutError):
            return "timeout"
        if isinstance(exc, httpx.HTTPError):
            return "transport"
        return None

    async def aclose(self) -> None:
        """See :meth:`UpstreamHTTP.aclose`."""
        for client in self.clients:
            await client.aclose()


__all__ = [
    "AiohttpUpstream",
    "ConnectionFailureKind",
    "HTTPAnswer",
    "HttpxUpstream",
    "UpstreamHTTP",
    "UpstreamStream",
    "split_lines",
]
