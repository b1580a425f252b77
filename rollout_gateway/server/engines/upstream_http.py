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

#: A request body: its bytes, or pieces that joined are its bytes (a long history's text
#: is a view written around, :func:`~rollout_gateway.server.http.jsonio.dumps_request_pieces`:
#: the lean client writes the pieces as they are, httpx gets them joined).
RequestContent = bytes | tuple[bytes | memoryview, ...]


def content_bytes(content: RequestContent) -> bytes:
    """``content`` as one ``bytes`` (the pieces joined)."""
    return content if isinstance(content, bytes) else b"".join(content)


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

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (lines end in ``\n`` or ``\r\n``): what
        :func:`~.streaming.iter_sse_json` reads, never decoded to text."""
        ...


def _join(base_url: str, url: str) -> str:
    return url if "://" in url else base_url.rstrip("/") + "/" + url.lstrip("/")


async def line_spans(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[bytes, int, int]]:
    """The lines of a byte stream as ``(buffer, start, stop)``: ``buffer[start:stop]`` is
    a line without its ``\n`` / ``\r\n``, never cut out of the buffer (vLLM's first
    chunk carries the whole prompt's ids on one line: 224 kB at a 32k context). Each line
    is found with ``find`` (memchr); a line longer than a chunk is joined once, when it
    ends (the partial line before it kept as a view, not copied out first)."""
    parts: list[bytes | memoryview] = []
    async for chunk in chunks:
        end = chunk.find(b"\n")
        if end < 0:
            parts.append(chunk)
            continue  # a line longer than the chunk: joined once it ends
        if parts:
            before = sum(len(part) for part in parts)
            parts.append(chunk)
            chunk, parts, end = b"".join(parts), [], end + before
        start = 0
        while end >= 0:
            stop = end - 1 if end > start and chunk[end - 1] == 13 else end  # 13: "\r"
            yield chunk, start, stop
            start = end + 1
            end = chunk.find(b"\n", start)
        if start < len(chunk):
            parts = [memoryview(chunk)[start:]]
    if parts:
        last = b"".join(parts)
        yield last, 0, len(last) - 1 if last.endswith(b"\r") else len(last)


async def split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a byte stream (:func:`line_spans`) as text (invalid UTF-8 replaced)."""
    async for buffer, start, stop in line_spans(chunks):
        yield str(memoryview(buffer)[start:stop], "utf-8", "replace")


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

    async def chunks(self) -> AsyncIterator[bytes]:
        # httpx's own line splitting (which also ends a line at a lone "\r"), each line
        # given back with a "\n": the lines read are those lines() reads.
        async for line in self._response.aiter_lines():
            yield line.encode() + b"\n"


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

    async def post(self, path: str, content: RequestContent) -> HTTPAnswer:
        """POST JSON ``content`` to ``path`` (under the base URL, or absolute)."""
        response = await self.client.post(
            _join(self.base_url, path), content=content_bytes(content), headers=_JSON
        )
        return HTTPAnswer(response.status_code, response.content, response.reason_phrase)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, content: RequestContent) -> AsyncIterator[UpstreamStream]:
        """POST JSON ``content``; the answer streamed (closed when the context exits)."""
        client = self.client
        request = client.build_request(
            "POST", _join(self.base_url, path), content=content_bytes(content), headers=_JSON
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
    "RequestContent",
    "content_bytes",
    "ConnectionFailureKind",
    "HTTPAnswer",
    "HttpxCalls",
    "UpstreamStream",
    "line_spans",
    "split_lines",
]
