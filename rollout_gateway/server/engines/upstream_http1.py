"""The gateway's upstream client: lean HTTP/1.1 for every turn's ``POST /chat/completions``.

Every turn makes one upstream call, the chat POST (its answer whole, or streamed), and
needs little of an HTTP client: a keep-alive connection, the request's bytes written, the
answer's status and body read. A general client runs a good deal of Python around that on
every call (request and response objects, header multidicts, cookie and tracing hooks,
timeout handles): aiohttp's was the largest piece of the gateway's own CPU per turn at 64
rollouts in flight (``benchmarks/gateway_overhead.py``), httpx's three times that.
:class:`Http1Upstream` makes those POSTs over asyncio's transports (uvloop's, under
``serve``) with httptools' response parser, the C parser uvicorn serves the agents with;
everything else (GETs, a POST to another origin) goes through httpx
(:class:`~.upstream_http.HttpxCalls`), as does every call when a test injects a transport.

Connections are reused most recent first (a rollout that runs alone keeps one warm). One
that idled longer than ``keepalive_s`` is closed rather than reused: the engines' HTTP
servers (uvicorn, for vLLM and SGLang) close idle connections after 5 s, and a request
written just as the server closes its connection is lost (a POST is not retried). A
connection whose call did not end with a whole answer (cancelled, timed out, broken) is
closed, never reused: closing is also what tells the engine to stop generating.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import unquote, urlsplit

import httptools
import httpx

from rollout_gateway.server.engines.upstream_http import (
    ConnectionFailureKind,
    HTTPAnswer,
    HttpxCalls,
    RequestContent,
    UpstreamStream,
    split_lines,
)

#: Idle connections older than this are closed, not reused (below uvicorn's 5 s).
DEFAULT_KEEPALIVE_S = 4.0

#: The most one read of an answer takes: uvloop's own read buffer's size, so that an
#: answer comes in as many reads as it did when uvloop read it (a 32k context's 224 kB
#: answer, its prompt's ids, in one).
READ_BUFFER_BYTES = 256_000


class Http1ConnectError(ConnectionError):
    """The upstream could not be reached (refused, unresolvable, connect timeout)."""


class Http1TransportError(ConnectionError):
    """The connection broke, or the upstream's answer was not HTTP/1.1."""


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection to the upstream; one request at a time.

    The answer is read into ``read_buffer`` (a buffered protocol), not into a ``bytes``
    the event loop makes for each read: httptools hands each piece of the answer on as
    bytes of its own anyway, so the loop's copy was a second copy of every answer (at a
    32k context, its 224 kB of prompt ids, about 0.15 M instructions a turn).

    Args:
        on_lost: called once the connection is closed (the pool forgets it).
        read_buffer: where the transport reads to. It may be shared by the connections
            of one event loop: a read and its :meth:`buffer_updated` run back to back,
            and nothing of the buffer is kept past it (httptools copies what it hands on).
    """

    def __init__(
        self, on_lost: Callable[[_Connection], None], read_buffer: memoryview | None = None
    ) -> None:
        self._on_lost = on_lost
        if read_buffer is None:
            read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))
        self._read_buffer = read_buffer
        # The connection's loop, kept: asyncio.get_running_loop() costs a getpid()
        # system call each time (CPython 3.11 checks for a fork), several per turn.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[HTTPAnswer] | None = None
        self._expecting = False  # a request is out and its answer not complete
        self._body: list[bytes] = []
        self._reason = b""
        self._framed = False  # the answer says its length (Content-Length or chunked)
        self._headers_done = False
        self.status_code = 0
        # A streamed answer: its head awaited, then its chunks as they come.
        self._head: asyncio.Future[None] | None = None
        self._wake: asyncio.Event | None = None
        self._error: Exception | None = None

    async def request(self, head: bytes, body: RequestContent) -> HTTPAnswer:
        """Write one request (its head, then its body's pieces: no copy of them joined);
        its whole answer."""
        assert self.transport is not None
        self.reusable = False
        self._expecting = True
        self._answer = self.loop.create_future()
        self.transport.writelines(_pieces(head, body))
        try:
            return await self._answer
        finally:
            self._answer = None

    async def open_stream(self, head: bytes, body: RequestContent) -> None:
        """Write one request; return once its answer's head is in (``status_code``). The
        body comes from :meth:`chunks`."""
        assert self.transport is not None
        self.reusable = False
        self._expecting = True
        self._error = None
        self._wake = asyncio.Event()
        self._head = self.loop.create_future()
        self.transport.writelines(_pieces(head, body))
        try:
            await self._head
        finally:
            self._head = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The streamed answer's body as it arrives (raises if the connection breaks)."""
        assert self._wake is not None
        while True:
            if self._body:
                body, self._body = self._body, []
                yield b"".join(body)
            elif self._error is not None:
                raise self._error
            elif not self._expecting:  # the answer is complete
                return
            else:
                self._wake.clear()
                await self._wake.wait()

    def finish(self) -> bool:
        """The call is done with the connection: whether its answer arrived whole and was
        all taken (then the connection may be reused, if ``reusable``)."""
        whole = not self._expecting and self._error is None and not self._body
        self._wake = None
        self._body = []  # an idle connection keeps no answer alive
        return whole

    def close(self) -> None:
        """Close the connection (an answer still awaited fails)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:  # noqa: D102
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:  # noqa: D102
        if not self._expecting:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        try:
            self._parser.feed_data(self._read_buffer[:nbytes])
        except httptools.HttpParserError as exc:
            self._fail(Http1TransportError(f"the upstream's answer is not HTTP/1.1: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:  # noqa: D102
        if self._expecting and self._headers_done and not self._framed:
            self._complete()  # an answer delimited by the end of the connection
        return None  # close

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self.closed = True
        self._fail(Http1TransportError(f"the upstream closed the connection: {exc or 'EOF'}"))
        self._on_lost(self)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:  # noqa: D102
        self._body = []
        self._reason = b""
        self._framed = False
        self._headers_done = False

    def on_status(self, status: bytes) -> None:  # noqa: D102
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:  # noqa: D102
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value):
            self._framed = True

    def on_headers_complete(self) -> None:  # noqa: D102
        self._headers_done = True
        self.status_code = self._parser.get_status_code()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:  # noqa: D102
        self._body.append(body)
        if self._wake is not None:
            self._wake.set()

    def on_message_complete(self) -> None:  # noqa: D102
        self.reusable = self._parser.should_keep_alive()
        self._complete()

    @property
    def reason(self) -> str:
        """The answer's reason phrase."""
        return self._reason.decode("latin-1")

    def _complete(self) -> None:
        self._expecting = False
        if self._wake is not None:  # streamed: chunks() takes what is left, then ends
            self._wake.set()
            return
        body, self._body = self._body, []  # an idle connection keeps no answer alive
        if self._answer is not None and not self._answer.done():
            answer = HTTPAnswer(self.status_code, b"".join(body), self.reason)
            self._answer.set_result(answer)

    def _fail(self, exc: Exception) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        if self._wake is not None and self._expecting:
            self._error = exc
            self._wake.set()


class _Http1Stream:
    """A streamed answer on a :class:`_Connection` (:class:`~.upstream_http.UpstreamStream`)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status_code = conn.status_code

    async def read(self) -> HTTPAnswer:
        """The rest of the body, whole (error answers)."""
        parts = [chunk async for chunk in self._conn.chunks()]
        return HTTPAnswer(self.status_code, b"".join(parts), self._conn.reason)

    def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive."""
        return split_lines(self._conn.chunks())

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        return self._conn.chunks()


class Http1Upstream:
    """The HTTP client of one upstream: its POSTs to the upstream's origin (whole or
    streamed answers) run on :class:`_Connection` (see the module docstring); every other
    call, and every call when ``transport`` is given, goes through httpx
    (:class:`~.upstream_http.HttpxCalls`).

    Args:
        base_url: the upstream's OpenAI base URL (``http`` or ``https``; credentials in it
            are sent as HTTP basic auth).
        headers: sent with every request (the upstream's API key).
        connect_timeout_s: connect timeout (a dead upstream fails fast).
        max_connections: connections open at once (a call waits for one beyond).
        keepalive_s: an idle connection older than this is closed, not reused.
        ssl_context: TLS settings for an ``https`` base URL (default: the system's
            trust store, the host name checked).
        transport: an httpx transport every call goes through (tests: an in-process
            fake engine).
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        ssl_context: ssl.SSLContext | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url: an http(s) URL with a host, got {base_url!r}")
        for name, value in (headers or {}).items():
            if any(c in f"{name}{value}" for c in "\r\n\0"):
                raise ValueError(f"headers: {name!r} holds a line break or NUL")
        credentials = _basic_auth(parts.username, parts.password)
        if credentials and any(k.lower() == "authorization" for k in headers or {}):
            raise ValueError("base_url: credentials and an Authorization header: give one")
        #: Whether the chat POSTs take the lean connections (not with a test transport).
        self._lean = transport is None
        self._host = parts.hostname
        self._tls = parts.scheme == "https"
        self._port = parts.port or (443 if self._tls else 80)
        netloc = parts.netloc.rsplit("@", 1)[-1]
        self._origin = f"{parts.scheme}://{netloc}"
        self._path = parts.path
        fields = {
            "Host": netloc,
            **(headers or {}),
            **credentials,
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
        }
        self._header_lines = "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode("latin-1")
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._slots = asyncio.Semaphore(max_connections)
        #: What the connections read answers to, one buffer for all (see _Connection).
        self._read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._sweep: asyncio.TimerHandle | None = None
        self._ssl = ssl_context
        self.fallback = HttpxCalls(
            base_url,
            transport=transport,
            headers=headers,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
            ssl_context=ssl_context,
        )

    async def post(self, path: str, content: RequestContent) -> HTTPAnswer:
        """POST JSON ``content`` to ``base_url + path`` (or to ``path`` when it is an
        absolute URL, e.g. vLLM's root-level token-in endpoint); the whole answer."""
        head = self._request_head(path, _length(content))
        if head is None:
            return await self.fallback.post(path, content)
        async with self._slots:
            conn = self._reuse() or await self._connect()  # not a coroutine more per call
            self._busy.add(conn)
            try:
                return await conn.request(head, content)
            finally:
                self._give(conn)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, content: RequestContent) -> AsyncIterator[UpstreamStream]:
        """POST JSON ``content``; the answer streamed. Leaving it before the answer's end
        closes the connection (the engine stops generating)."""
        head = self._request_head(path, _length(content))
        if head is None:
            async with self.fallback.stream(path, content) as answer:
                yield answer
            return
        async with self._slots:
            conn = self._reuse() or await self._connect()
            self._busy.add(conn)
            try:
                await conn.open_stream(head, content)
                yield _Http1Stream(conn)
            finally:
                self._give(conn)

    async def get(
        self, url: str, *, timeout_s: float, params: Mapping[str, str] | None = None
    ) -> HTTPAnswer:
        """GET ``url`` (absolute, or a path under ``base_url``) within ``timeout_s`` (httpx)."""
        return await self.fallback.get(url, timeout_s=timeout_s, params=params)

    def failure_kind(self, exc: BaseException) -> ConnectionFailureKind | None:
        """How ``exc`` raised by a call failed (``None``: not a connection failure)."""
        if isinstance(exc, Http1ConnectError):
            return "connect"
        if isinstance(exc, Http1TransportError):
            return "transport"
        return self.fallback.failure_kind(exc)

    async def aclose(self) -> None:
        """Close every connection."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        await self.fallback.aclose()

    @property
    def open_connections(self) -> int:
        """Connections open now (idle or answering)."""
        return sum(1 for c in self._idle if not c.closed) + len(self._busy)

    @property
    def idle_connections(self) -> int:
        """Connections kept for reuse (a closed one is not kept)."""
        return len(self._idle)

    def _request_head(self, path: str, length: int) -> bytes | None:
        """A POST's head for ``path`` (under the base URL, or absolute on its origin);
        ``None`` when the call goes through httpx (another origin, a test transport)."""
        if not self._lean:
            return None
        if "://" in path:
            if not path.startswith(self._origin + "/"):
                return None
            target = path[len(self._origin) :]
        else:
            target = self._path + "/" + path.lstrip("/")
        return b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n" % (
            target.encode("ascii"),
            self._header_lines,
            length,
        )

    def _give(self, conn: _Connection) -> None:
        """A call is done with ``conn``: kept for reuse when its answer came whole and
        the server keeps it open; else closed (its state is unknown, and closing tells
        the engine to stop)."""
        self._busy.discard(conn)
        if conn.finish() and conn.reusable and not conn.closed:
            conn.idle_since = conn.loop.time()
            self._idle.append(conn)
            self._sweep_later(conn.loop)
        else:
            conn.close()

    def _forget(self, conn: _Connection) -> None:
        # Closed (by either side): an idle connection leaves the pool at once.
        if conn in self._idle:
            self._idle.remove(conn)

    def _sweep_later(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close idle connections once they are too old to reuse, even when no call
        comes to find them (one timer per pool at a time)."""
        if self._sweep is None:
            self._sweep = loop.call_later(self._keepalive_s + 0.05, self._close_stale, loop)

    def _close_stale(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep = None
        now = loop.time()
        while self._idle and now - self._idle[0].idle_since > self._keepalive_s:
            self._idle.pop(0).close()  # oldest first: reuse takes the newest
        if self._idle:
            self._sweep_later(loop)

    def _reuse(self) -> _Connection | None:
        """The newest idle connection still fresh enough to reuse (staler ones close)."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.loop.time() - conn.idle_since <= self._keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self._tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self._forget, self._read_buffer),
                    self._host,
                    self._port,
                    ssl=self._ssl if self._tls else None,
                    server_hostname=self._host if self._tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise Http1ConnectError(
                f"cannot connect to {self._host}:{self._port}: {exc or 'timed out'}"
            ) from exc
        return conn


def _length(content: RequestContent) -> int:
    """The bytes ``content`` holds (a piece is bytes or a view of bytes)."""
    return len(content) if isinstance(content, bytes) else sum(map(len, content))


def _pieces(head: bytes, body: RequestContent) -> tuple[bytes | memoryview, ...]:
    """A request's head and its body's pieces, as one ``writelines`` takes them."""
    return (head, body) if isinstance(body, bytes) else (head, *body)


def _basic_auth(username: str | None, password: str | None) -> dict[str, str]:
    """The ``Authorization`` header of credentials in a URL (none without them)."""
    if not (username or password):
        return {}
    pair = f"{unquote(username or '')}:{unquote(password or '')}".encode()
    return {"Authorization": "Basic " + base64.b64encode(pair).decode("ascii")}


__all__ = [
    "DEFAULT_KEEPALIVE_S",
    "Http1ConnectError",
    "Http1TransportError",
    "Http1Upstream",
]
