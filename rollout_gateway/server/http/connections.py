"""The gateway's HTTP server protocol: uvicorn's httptools protocol plus connection limits.

uvicorn bounds idle keep-alive time but not how long a client may take to send a
request: a connection that sends nothing, or drips its headers or body a byte at a time
(slowloris), is held forever, and nothing caps the number of connections. With 500
sandboxes of a training step each able to open hundreds of sockets, that is a way for one
agent to take the gateway down for all. :class:`LimitedHttpToolsProtocol` (built for one
server by :func:`limited_protocol`)

* closes a connection whose request line and headers are not complete within
  ``header_timeout_s`` of its first byte (or of the connection's opening);
* closes a connection whose body is not complete within ``body_timeout_s`` of its headers;
* keeps at most ``max_connections`` open: a new connection beyond them closes the one
  that has been idle longest, i.e. not in the middle of a request the app is answering
  (silent since it opened, between keep-alive requests, or still sending its request
  line, headers or body), and is itself closed only when every other connection is busy
  with a request. Idle sockets held open from inside sandboxes (a slowloris from every
  sandbox at once) then cannot lock agents out: they are the oldest, and go first;
* answers 431 and closes a connection whose request line and headers grow past
  ``max_header_bytes`` (the parser keeps them whole in memory, and nothing else bounds
  them: one agent could send gigabytes of headers within the header timeout);
* answers a request it cannot parse (bad chunk sizes, conflicting ``Content-Length``)
  with the gateway's JSON error shape instead of uvicorn's plain text;
* times what reading each request costs the server (:class:`ReadTimer`, in the request's
  ASGI scope under :data:`READ_TIMER_KEY` of ``extensions``), so that the app can charge
  a big body's reading to its sender (:mod:`.intake`);
* sends a response's status line and headers together with the first piece of its body
  (:class:`HeadersWithBody`): one ``send`` instead of two, and one wake-up of the client
  instead of two (on loopback, a send costs the kernel's whole TCP path and the peer's
  wake-up: the largest share of the server's CPU per turn in
  ``benchmarks/gateway_overhead.py``);
* hands a request body that arrives in one piece to the app as the bytes the parser made
  (:meth:`LimitedHttpToolsProtocol.on_body`), not copied twice more (uvicorn appends each
  piece to a ``bytearray``, then copies that into ``bytes`` for the app: at a 32k context
  two passes over the whole history every turn).

Time spent waiting for the model is not bounded here (the upstream deadline does that).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HIGH_WATER_LIMIT, HttpToolsProtocol

from rollout_gateway.server.http.responses import error_response

logger = logging.getLogger("rollout_gateway.server")


class HeadersWithBody:
    """A transport wrapper that holds a response's head (status line and headers) until
    the next write, and sends both with one ``writelines``.

    The head goes out alone at the end of the event-loop iteration when no body follows
    in it (a ``HEAD`` answer, a stream whose first event is not ready), so nothing waits
    longer than one iteration. Everything else is the wrapped transport's.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        """Hold a response head; send held head and ``data`` together."""
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.writelines((head, data))
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Send a held head now."""
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        """Send what is held, then close."""
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        """Send what is held, then end the sending side."""
        self.flush()
        self._transport.write_eof()

    def is_closing(self) -> bool:
        """Whether the wrapped transport is closing."""
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: Seconds a connection refused for its headers is still read (and dropped) before it
#: is closed, so that the answer reaches a client still sending.
REFUSED_LINGER_S = 1.0

#: Where a request's :class:`ReadTimer` is, in its scope's ``extensions``.
READ_TIMER_KEY = "rollout_gateway.read_timer"


class ReadTimer:
    """Seconds the server spent reading one request (parsing what arrived, buffering its
    body), by the wall clock around each read: one clock read (tens of nanoseconds) per
    piece received."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds of one server's connections (see the module docstring)."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 120.0
    max_connections: int = 4096
    #: Request line and headers of one request, in bytes (the OpenAI SDK sends ~1 KiB).
    max_header_bytes: int = 64 * 1024


@dataclass
class ConnectionStats:
    """What the limits did (read by the gateway's metrics)."""

    refused_connections: int = 0
    evicted_connections: int = 0
    header_timeouts: int = 0
    body_timeouts: int = 0
    oversized_headers: int = 0


def error_answer(
    status: int, reason: str, message: str, code: str, default_headers: Any = ()
) -> bytes:
    """A whole HTTP/1.1 error answer in the gateway's JSON shape, closing the connection
    (written on the socket: the request never reached the app)."""
    body = bytes(error_response(status, message, "invalid_request_error", code=code).body)
    head = [f"HTTP/1.1 {status} {reason}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head.append(
        b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % len(body)
    )
    return b"".join(head) + body


class IdleConnections:
    """A server's connections that are not in the middle of a request the app is
    answering, longest idle first: the ones closed to make room at the connection cap."""

    def __init__(self, stats: ConnectionStats) -> None:
        self._stats = stats
        self._idle: OrderedDict[asyncio.BaseProtocol, asyncio.BaseTransport] = OrderedDict()

    def idle(self, protocol: asyncio.BaseProtocol, transport: asyncio.BaseTransport) -> None:
        """``protocol`` is idle from now (new, or its answer was sent)."""
        self._idle[protocol] = transport
        self._idle.move_to_end(protocol)

    def busy(self, protocol: asyncio.BaseProtocol) -> None:
        """``protocol`` has a request for the app to answer, or is gone."""
        self._idle.pop(protocol, None)

    def make_room(self, newcomer: asyncio.BaseProtocol) -> bool:
        """Close the longest-idle connection other than ``newcomer`` (whether one was)."""
        while self._idle:
            oldest, transport = self._idle.popitem(last=False)
            if oldest is newcomer or transport.is_closing():
                continue
            self._stats.evicted_connections += 1
            logger.debug("closing the longest-idle connection: the connection cap is reached")
            transport.close()
            return True
        return False


class ConnectionPolicy:
    """One server's connection limits, the counters of what they did, and its idle
    connections (shared by every connection the server accepts)."""

    def __init__(self, limits: ConnectionLimits, stats: ConnectionStats | None = None) -> None:
        self.limits = limits
        self.stats = stats if stats is not None else ConnectionStats()
        self.idle = IdleConnections(self.stats)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol enforcing a :class:`ConnectionPolicy` (see the module
    docstring; its transport is a :class:`HeadersWithBody`). What it relies on of uvicorn
    is pinned by ``tests/server/http/test_uvicorn_contract.py``, uvicorn by its version."""

    _deadline: asyncio.TimerHandle | None = None
    #: The connection's own transport (this class's checks skip the wrapper's frame).
    _raw: asyncio.Transport
    #: Whether the current request's head (request line, headers) is being read.
    _in_head = True
    #: Bytes of the current request's head received so far.
    _head_bytes = 0
    #: Requests read whole on this connection.
    _requests = 0
    _refused = False
    #: The current request's (set once its headers are read).
    _read_timer: ReadTimer | None = None

    def __init__(self, *args: Any, policy: ConnectionPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        # Read on every request: one attribute away, not two.
        self._limits, self._idle = policy.limits, policy.idle

    def data_received(self, data: bytes) -> None:
        if self._refused or self._raw.is_closing():
            return  # refused already: the rest is dropped unparsed
        in_head, requests = self._in_head, self._requests
        started = perf_counter()
        super().data_received(data)
        if self._read_timer is not None:
            self._read_timer.seconds += perf_counter() - started
        # Counted after parsing, only when the whole piece is still the same head: a piece
        # that completes a head may carry a body and the next request. The bound is thus
        # reached at most one read (<= 256 KiB) late.
        same_head = in_head and self._in_head and self._requests == requests
        if same_head and not self._raw.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self._limits.max_header_bytes:
                self._refuse_head()

    def _refuse_head(self) -> None:
        limit = self._limits.max_header_bytes
        self.policy.stats.oversized_headers += 1
        self._disarm()
        self._refused = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # an earlier (pipelined) answer is under way
            return
        self.transport.write(
            error_answer(
                431,
                "Request Header Fields Too Large",
                f"request headers exceed {limit} bytes",
                "request_headers_too_large",
                self.server_state.default_headers,
            )
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
        # Closing with the client's bytes unread would reset the connection, and the
        # client could lose the answer: read and drop them for a moment first.
        self._deadline = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a request it cannot parse, in the gateway's JSON shape.
        answer = error_answer(
            400,
            "Bad Request",
            "invalid HTTP request",
            "invalid_http_request",
            self.server_state.default_headers,
        )
        self.transport.write(answer)
        self.transport.close()

    def _arm(self, seconds: float, kind: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire, kind)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, kind: str) -> None:
        self._deadline = None
        if kind == "header":
            self.policy.stats.header_timeouts += 1
        else:
            self.policy.stats.body_timeouts += 1
        logger.debug("closing a connection: %s timeout", kind)
        if not self._raw.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # Every answer on this connection leaves through the wrapper: head and body together.
        self._raw = transport
        sends = HeadersWithBody(transport, self.loop)
        super().connection_made(sends)  # type: ignore[arg-type]
        policy = self.policy
        if len(self.connections) > policy.limits.max_connections and not policy.idle.make_room(
            self
        ):
            policy.stats.refused_connections += 1
            transport.close()
            return
        policy.idle.idle(self, sends)  # type: ignore[arg-type]
        self._arm(policy.limits.header_timeout_s, "header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._idle.busy(self)
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Kept alive, and no pipelined request started in its place: idle until the client
        # sends its next request.
        cycle = self.cycle
        if not self._raw.is_closing() and (cycle is None or cycle.response_complete):
            self._idle.idle(self, self.transport)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self._limits.header_timeout_s, "header")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self._limits.body_timeout_s, "body")
        self._read_timer = ReadTimer()
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
        extensions[READ_TIMER_KEY] = self._read_timer
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        # uvicorn's, but for the body held: the first piece since the app last received
        # is held as the bytes it is (uvicorn's ``receive`` hands ``bytes(held)`` over:
        # the very object), a later one joins it in a ``bytearray`` as uvicorn's always do.
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        held: bytes | bytearray = cycle.body
        if not held:
            held = body
        else:
            if type(held) is bytes:
                held = bytearray(held)
            held += body
        cycle.body = held  # type: ignore[assignment]
        if len(held) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self._idle.busy(self)  # the app answers it now: never closed to make room
        self._disarm()
        self._in_head, self._head_bytes = True, 0  # the next request's head
        self._requests += 1
        super().on_message_complete()


def limited_protocol(
    limits: ConnectionLimits, stats: ConnectionStats | None = None
) -> Callable[..., LimitedHttpToolsProtocol]:
    """The uvicorn HTTP protocol of one server enforcing ``limits`` (pass it as ``http=``:
    uvicorn builds each connection's protocol by calling it)."""
    return functools.partial(LimitedHttpToolsProtocol, policy=ConnectionPolicy(limits, stats))


def uvicorn_options(config: Any, max_connections: int) -> dict[str, Any]:
    """uvicorn settings of a :class:`~rollout_gateway.server.config.GatewayConfig`, with
    ``max_connections`` open at most (the gateway's plan: :mod:`.fds`)."""
    limits = ConnectionLimits(
        header_timeout_s=config.connections.header_timeout_s,
        body_timeout_s=config.connections.body_timeout_s,
        max_connections=max_connections,
    )
    return {
        "http": limited_protocol(limits),
        "timeout_keep_alive": config.connections.keep_alive_s,
        # Nothing reads the client's address: no X-Forwarded-* rewriting layer per request
        # (an agent behind a loopback tunnel could set them anyway).
        "proxy_headers": False,
        "server_header": False,
    }


__all__ = [
    "READ_TIMER_KEY",
    "HeadersWithBody",
    "ConnectionLimits",
    "ConnectionPolicy",
    "ConnectionStats",
    "IdleConnections",
    "LimitedHttpToolsProtocol",
    "ReadTimer",
    "error_answer",
    "limited_protocol",
    "uvicorn_options",
]
