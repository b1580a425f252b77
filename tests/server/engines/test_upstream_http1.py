"""Http1Upstream: the lean whole-answer POST, against a raw loopback server whose every
byte the test chooses (keep-alive, close, chunked, garbage, a stalled answer)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from rollout_gateway.server.engines.upstream_http1 import READ_BUFFER_BYTES, Http1Upstream

Reply = Callable[[bytes], bytes | None]  # request body -> raw answer (None: hang)


def answer(body: bytes, *, close: bool = False, status: str = "200 OK") -> bytes:
    extra = b"Connection: close\r\n" if close else b""
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status.encode(),
        len(body),
        extra,
        body,
    )


@dataclass
class RawServer:
    """Counts connections, keeps every request's head, answers with ``reply``."""

    reply: Reply = lambda body: answer(b'{"ok": true}')  # noqa: E731
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    heads: list[bytes] = field(default_factory=list)
    disconnects: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def close_all(self) -> None:
        """Close every connection, as a server does with idle keep-alive ones."""
        for writer in self.writers:
            writer.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                raw = self.reply(body)
                if raw is None:
                    await reader.read()  # hang until the client goes away
                    self.disconnects += 1
                    return
                writer.write(raw)
                await writer.drain()
                if b"Connection: close" in raw or raw.startswith(b"HTTP/1.0"):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self.open_now -= 1
            writer.close()


@contextlib.asynccontextmanager
async def serving(server: RawServer) -> AsyncIterator[str]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        listener.close()


async def test_calls_reuse_one_keep_alive_connection_and_send_one_well_formed_request() -> None:
    server = RawServer(reply=lambda body: answer(b'{"echo": ' + body + b"}"))
    async with serving(server) as url:
        client = Http1Upstream(url, headers={"Authorization": "Bearer k"})
        for i in range(3):
            got = await client.post("/chat/completions", b'{"n": %d}' % i)
            assert (got.status_code, got.content) == (200, b'{"echo": {"n": %d}}' % i)
        await client.aclose()
    assert server.connections == 1
    head = server.heads[0].decode()
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
    for line in ("Host: 127.0.0.1:", "Authorization: Bearer k", "Content-Length: 8",
                 "Content-Type: application/json", "Accept-Encoding: identity"):  # fmt: skip
        assert line in head


@pytest.mark.parametrize(
    "raw",
    [
        answer(b"whole", close=True),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nwh\r\n3\r\nole\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\nwhole",  # delimited by the end of the connection
    ],
    ids=["connection-close", "chunked", "read-to-end"],
)
async def test_every_way_of_delimiting_an_answer_gives_the_whole_body(raw: bytes) -> None:
    server = RawServer(reply=lambda body: raw)
    async with serving(server) as url:
        client = Http1Upstream(url)
        for _ in range(2):
            got = await client.post("/chat/completions", b"{}")
            assert (got.status_code, got.content) == (200, b"whole")
        await client.aclose()
    closes = b"close" in raw or raw.startswith(b"HTTP/1.0")
    assert server.connections == (2 if closes else 1)


async def test_an_error_status_is_an_answer_with_its_reason() -> None:
    server = RawServer(reply=lambda body: answer(b'{"error": "x"}', status="503 Busy Now"))
    async with serving(server) as url:
        client = Http1Upstream(url)
        got = await client.post("/chat/completions", b"{}")
        await client.aclose()
    assert (got.status_code, got.reason, got.content) == (503, "Busy Now", b'{"error": "x"}')


async def test_idle_connections_past_keepalive_or_closed_by_the_server_are_not_reused() -> None:
    server = RawServer()
    async with serving(server) as url:
        stale = Http1Upstream(url, keepalive_s=0.0)  # every idle connection is too old
        await stale.post("/chat/completions", b"{}")
        await stale.post("/chat/completions", b"{}")
        assert server.connections == 2 and stale.open_connections == 1
        await stale.aclose()
        # The server closes the idle connection: the next call opens a new one.
        server.reply = lambda body: answer(b"{}", close=False)
        client = Http1Upstream(url)
        await client.post("/chat/completions", b"{}")
        server.reply = lambda body: answer(b"{}", close=True)
        await client.post("/chat/completions", b"{}")
        await asyncio.sleep(0)  # the server's close arrives
        server.reply = lambda body: answer(b"{}")
        got = await client.post("/chat/completions", b"{}")
        assert got.status_code == 200 and server.connections == 4
        await client.aclose()


async def test_a_cancelled_call_closes_its_connection_and_the_engine_sees_it() -> None:
    server = RawServer(reply=lambda body: None if body == b"slow" else answer(b"{}"))
    async with serving(server) as url:
        client = Http1Upstream(url)
        await client.post("/chat/completions", b"{}")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.post("/chat/completions", b"slow")
        assert client.failure_kind(TimeoutError()) == "timeout"
        for _ in range(50):
            if server.disconnects:
                break
            await asyncio.sleep(0.01)
        assert server.disconnects == 1  # the engine was told (it stops generating)
        assert (await client.post("/chat/completions", b"{}")).status_code == 200
        assert server.connections == 2  # the cancelled call's connection was not reused
        await client.aclose()


async def test_garbage_and_a_dead_upstream_are_transport_and_connect_failures() -> None:
    server = RawServer(reply=lambda body: b"SSH-2.0-OpenSSH\r\n\r\nnot http at all")
    async with serving(server) as url:
        client = Http1Upstream(url)
        with pytest.raises(ConnectionError) as caught:
            await client.post("/chat/completions", b"{}")
        assert client.failure_kind(caught.value) == "transport"
        assert client.open_connections == 0  # the broken connection is not kept
        await client.aclose()
    dead = Http1Upstream(url)  # the listener is closed now
    with pytest.raises(ConnectionError) as caught:
        await dead.post("/chat/completions", b"{}")
    assert dead.failure_kind(caught.value) == "connect"
    assert dead.open_connections == 0
    await dead.aclose()


async def test_connections_are_bounded_and_calls_beyond_wait_for_one() -> None:
    gate = asyncio.Event()
    server = RawServer()

    async def slow_handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        await RawServer.handle(server, reader, writer)

    listener = await asyncio.start_server(slow_handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}/v1"
    client = Http1Upstream(url, max_connections=2)
    calls = [asyncio.create_task(client.post("/chat/completions", b"{}")) for _ in range(5)]
    await asyncio.sleep(0.05)
    gate.set()
    answers = await asyncio.gather(*calls)
    assert [a.status_code for a in answers] == [200] * 5
    assert server.most_open <= 2 and server.connections == 2
    await client.aclose()
    listener.close()


async def test_other_origins_go_through_httpx_and_credentials_are_basic_auth() -> None:
    here, there = RawServer(), RawServer()
    async with serving(here) as url, serving(there) as other:
        client = Http1Upstream(url)
        got = await client.post(other.removesuffix("/v1") + "/inference/v1/generate", b"{}")
        assert got.status_code == 200 and (here.connections, there.connections) == (0, 1)
        assert client.open_connections == 0  # httpx answered that one, not the lean pool
        await client.aclose()
        host = url.removeprefix("http://")
        with_auth = Http1Upstream(f"http://user:pa%40ss@{host}")
        await with_auth.post("/chat/completions", b"{}")
        assert with_auth.open_connections == 1  # the lean path sends them
        await with_auth.aclose()
    token = base64.b64encode(b"user:pa@ss").decode()
    assert f"Authorization: Basic {token}".encode() in here.heads[-1]
    assert b"user" not in here.heads[-1].split(b"Authorization")[0]  # not in the Host line
    with pytest.raises(ValueError, match="credentials and an Authorization header"):
        Http1Upstream(f"http://u:p@{host}", headers={"Authorization": "Bearer k"})


async def test_an_injected_transport_takes_every_call() -> None:
    seen: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url}")
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": []})
        return httpx.Response(200, text="data: {}\n\ndata: [DONE]\n\n")

    client = Http1Upstream("http://engine/v1", transport=httpx.MockTransport(engine))
    assert (await client.post("/chat/completions", b"{}")).status_code == 200
    async with client.stream("/chat/completions", b"{}") as answer:
        assert [line async for line in answer.lines()] == ["data: {}", "", "data: [DONE]", ""]
    assert (await client.get("/models", timeout_s=1)).status_code == 200
    await client.aclose()
    assert seen == [
        "POST http://engine/v1/chat/completions",
        "POST http://engine/v1/chat/completions",
        "GET http://engine/v1/models",
    ]


def test_header_values_that_could_split_the_request_are_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        Http1Upstream("http://engine/v1", headers={"Authorization": "Bearer k\r\nX-Evil: 1"})
    with pytest.raises(ValueError, match="http"):
        Http1Upstream("ftp://engine/v1")


async def test_idle_connections_are_closed_when_too_old_even_with_no_more_calls() -> None:
    server = RawServer()
    async with serving(server) as url:
        client = Http1Upstream(url, keepalive_s=0.05)
        await asyncio.gather(*(client.post("/chat/completions", b"{}") for _ in range(3)))
        assert client.open_connections == 3
        for _ in range(100):
            if client.open_connections == 0 and server.open_now == 0:
                break
            await asyncio.sleep(0.01)
        assert (client.open_connections, server.open_now) == (0, 0)
        await client.aclose()


async def test_a_connection_the_server_closes_while_idle_leaves_the_pool() -> None:
    server = RawServer()
    async with serving(server) as url:
        client = Http1Upstream(url)
        await asyncio.gather(*(client.post("/chat/completions", b"{}") for _ in range(3)))
        assert client.idle_connections == 3
        server.close_all()
        for _ in range(100):
            if client.idle_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert client.idle_connections == 0  # nothing kept of them
        assert (await client.post("/chat/completions", b"{}")).status_code == 200
        await client.aclose()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


@dataclass
class StreamingServer(RawServer):
    """Answers with the head and a first event, then the rest once ``more`` is set (or
    ``rest`` is None: never, the connection held until the client leaves)."""

    more: asyncio.Event = field(default_factory=asyncio.Event)
    rest: bytes | None = chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(SSE_HEAD + chunk(b'data: {"n": 1}\n\n'))
                await writer.drain()
                if self.rest is None:
                    await reader.read()
                    self.disconnects += 1
                    return
                await self.more.wait()
                writer.write(self.rest)
                await writer.drain()
                self.more.clear()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def test_a_streamed_answer_arrives_as_sent_and_its_connection_is_reused() -> None:
    server = StreamingServer()
    async with serving(server) as url:
        client = Http1Upstream(url)
        for _ in range(2):
            async with client.stream("/chat/completions", b"{}") as answer:
                assert answer.status_code == 200
                lines = answer.lines()
                assert await lines.__anext__() == 'data: {"n": 1}'  # before the rest is sent
                server.more.set()
                assert [line async for line in lines] == ["", "data: [DONE]", ""]
        assert server.connections == 1
        assert b"POST /v1/chat/completions HTTP/1.1" in server.heads[0]
        await client.aclose()


async def test_leaving_a_stream_before_its_end_closes_the_connection() -> None:
    server = StreamingServer(rest=None)
    async with serving(server) as url:
        client = Http1Upstream(url)
        async with client.stream("/chat/completions", b"{}") as answer:
            assert await answer.lines().__anext__() == 'data: {"n": 1}'
        for _ in range(100):
            if server.disconnects:
                break
            await asyncio.sleep(0.01)
        assert server.disconnects == 1 and client.open_connections == 0
        await client.aclose()


async def test_a_streamed_error_is_read_whole_and_a_broken_stream_is_a_transport_failure() -> None:
    server = RawServer(reply=lambda body: answer(b'{"error": "bad"}', status="400 Bad Request"))
    async with serving(server) as url:
        client = Http1Upstream(url)
        async with client.stream("/chat/completions", b"{}") as got:
            whole = await got.read()
        assert (got.status_code, whole.content, whole.reason) == (
            400,
            b'{"error": "bad"}',
            "Bad Request",
        )
        server.reply = lambda body: SSE_HEAD + chunk(b"data: {}\n\n")  # then the server leaves
        with pytest.raises(ConnectionError) as caught:
            async with client.stream("/chat/completions", b"{}") as got:
                server.close_all()
                [line async for line in got.lines()]
        assert client.failure_kind(caught.value) == "transport"
        assert client.open_connections == 0  # the broken connection is not kept
        await client.aclose()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "engine")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_an_https_upstream_is_reached_over_tls_and_its_certificate_is_checked(
    tmp_path: Path,
) -> None:
    cert, key = _self_signed(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    server = RawServer()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=served)
    url = f"https://127.0.0.1:{listener.sockets[0].getsockname()[1]}/v1"
    trusting = ssl.create_default_context(cafile=str(cert))
    client = Http1Upstream(url, ssl_context=trusting)
    for _ in range(2):
        assert (await client.post("/chat/completions", b"{}")).status_code == 200
    assert server.connections == 1
    await client.aclose()
    untrusting = Http1Upstream(url)  # the system's trust store does not know this certificate
    with pytest.raises(ConnectionError) as caught:
        await untrusting.post("/chat/completions", b"{}")
    assert untrusting.failure_kind(caught.value) == "connect"
    await untrusting.aclose()
    listener.close()


async def _two_big_answers_at_once(size: int) -> None:
    """Two calls in flight at once on two connections that share one read buffer, each
    answer several reads long: each call gets exactly the bytes its answer carried."""
    bodies = {b"a": bytes(range(256)) * (size // 256), b"b": b"[" + b"1234567," * (size // 8)}
    server = RawServer(reply=lambda body: answer(bodies[body]))
    async with serving(server) as url:
        client = Http1Upstream(url)
        got = await asyncio.gather(
            client.post("/chat/completions", b"a"), client.post("/chat/completions", b"b")
        )
        await client.aclose()
    assert [g.content for g in got] == [bodies[b"a"], bodies[b"b"]]
    assert server.connections == 2


async def test_answers_longer_than_a_read_arrive_whole_through_the_shared_read_buffer() -> None:
    await _two_big_answers_at_once(3 * READ_BUFFER_BYTES + 1000)


def test_answers_read_into_the_shared_buffer_arrive_whole_under_uvloop() -> None:
    """``serve`` runs on uvloop, whose transports read into a buffered protocol's buffer
    by their own code path."""
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(_two_big_answers_at_once(3 * READ_BUFFER_BYTES + 1000))


async def test_a_body_in_pieces_is_sent_as_its_joined_bytes_by_either_client() -> None:
    """A request body given in pieces (a long history's text written around, not joined:
    jsonio.dumps_request_pieces) reaches the engine as the joined bytes, on the lean
    connection and through httpx alike, its length counted in bytes."""
    text = '{"messages": [{"content": "h\u00e9"}]}'.encode()
    pieces = (text[:5], memoryview(text)[5:20], memoryview(text)[20:])
    seen: list[bytes] = []
    server = RawServer(reply=lambda body: seen.append(body) or answer(b"{}"))
    async with serving(server) as url:
        client = Http1Upstream(url)
        await client.post("/chat/completions", pieces)
        async with client.stream("/chat/completions", pieces) as streamed:
            await streamed.read()
        await client.post(url.replace("127.0.0.1", "localhost") + "/chat/completions", pieces)
        await client.aclose()
    assert seen == [text, text, text]
