"""Header/body timeouts and the connection cap on a live server (small configured limits)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from uvicorn import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.server.http.connections import (
    ConnectionLimits,
    HeadersWithBody,
    LimitedHttpToolsProtocol,
    limited_protocol,
)

ADMIN = "connections-admin-token-01"


@contextlib.asynccontextmanager
async def gateway(**limits: float) -> AsyncIterator[tuple[str, int]]:
    config = GatewayConfig.from_fields(
        upstreams=["http://127.0.0.1:9/v1"], admin_token=ADMIN, **limits
    )
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
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # never finishes
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


async def test_at_the_cap_the_longest_idle_connection_makes_room() -> None:
    """Silent sockets (a slowloris from inside sandboxes) cannot lock agents out, and a
    request being answered is never closed to make room."""
    async with gateway(max_connections=3, header_timeout_s=30) as (root, port):
        # The oldest connection: a request the app is answering (a 1 s exit long-poll).
        poll_reader, poll_writer = await asyncio.open_connection("127.0.0.1", port)
        poll_writer.write(
            b"GET /v1/rollouts/exits?after=0&timeout=1 HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + ADMIN.encode() + b"\r\n\r\n"
        )
        await poll_writer.drain()
        await asyncio.sleep(0.2)  # the request is with the app
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        async with httpx.AsyncClient() as client:  # the cap is reached: it still gets in
            assert (await client.get(f"{root}/health/live")).status_code == 200
        assert await closed_within(silent[0][0], 5)  # the longest idle made room
        # The long-poll was older than all of them, and is answered all the same.
        answer = await asyncio.wait_for(poll_reader.read(4096), 5)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        for _, w in [*silent, (poll_reader, poll_writer)]:
            w.close()


async def test_at_the_cap_with_every_connection_busy_a_new_one_is_closed() -> None:
    async with gateway(max_connections=2, header_timeout_s=30) as (root, port):
        polls = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET /v1/rollouts/exits?after=0&timeout=2 HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + ADMIN.encode() + b"\r\n\r\n"
            )
            await writer.drain()
            polls.append((reader, writer))
        await asyncio.sleep(0.2)  # both requests are with the app
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_within(reader, 1)  # closed at once: nothing idle to close
        writer.close()
        for poll_reader, poll_writer in polls:  # both answered
            assert (await asyncio.wait_for(poll_reader.read(4096), 5)).startswith(b"HTTP/1.1 200")
            poll_writer.close()


async def answer_to(port: int, request: bytes) -> tuple[bytes, dict[str, Any]]:
    """Send raw ``request``; the answer's status line and JSON body (the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    with contextlib.suppress(ConnectionError):  # the server may close before all is sent
        await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), raw
    return head.split(b"\r\n")[0], json.loads(body)


async def test_oversized_request_headers_are_431_and_the_connection_is_closed() -> None:
    async with gateway() as (root, port):
        huge = b"x" * (4 * 1024 * 1024)  # one header past the bound...
        many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(2000))  # ...or many
        for headers in (b"Idempotency-Key: " + huge + b"\r\n", many):
            request = b"GET /health/live HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
            status, body = await answer_to(port, request)
            assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
            assert (
                body["error"]["code"] == "request_headers_too_large"
                and "65536" in body["error"]["message"]
            )
        async with httpx.AsyncClient() as client:  # ordinary headers still pass
            r = await client.get(f"{root}/health/live", headers={"X-Big": "v" * 30_000})
            assert r.status_code == 200
        # The bound is per request: pipelined requests' heads do not add up.
        one = b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 40_000 + b"\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(one * 2 + b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert raw.count(b"HTTP/1.1 200 OK") == 3, raw


async def test_an_unparsable_request_gets_the_json_error_shape() -> None:
    async with gateway() as (_, port):
        bad_chunk = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
        )
        two_lengths = b"GET /health/live HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        for request in (bad_chunk, two_lengths):
            status, body = await answer_to(port, request)
            assert status == b"HTTP/1.1 400 Bad Request"
            assert body == {
                "error": {
                    "message": "invalid HTTP request",
                    "type": "invalid_request_error",
                    "code": "invalid_http_request",
                }
            }


async def test_keep_alive_connection_serves_requests_normally() -> None:
    async with gateway(header_timeout_s=0.5, body_timeout_s=0.5) as (root, _):
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                assert (await client.get(f"{root}/health/live")).status_code == 200
                await asyncio.sleep(0.2)


class RecordingTransport(asyncio.Transport):
    """Records what is sent, one entry per send (``writelines`` is one send)."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sends.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.sends.append(b"".join(list_of_data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_a_response_head_leaves_with_its_body_in_one_send() -> None:
    loop = asyncio.get_running_loop()
    transport = RecordingTransport()
    writer = HeadersWithBody(transport, loop)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    writer.write(b"{}")
    assert transport.sends == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    # A head without a body in the same loop iteration (HEAD, a stream not ready yet)
    # still leaves at the end of the iteration.
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    assert len(transport.sends) == 1
    await asyncio.sleep(0)
    assert transport.sends[-1].endswith(b"chunked\r\n\r\n")
    # "100 Continue" is not held (the client waits for it before sending its body).
    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert transport.sends[-1] == b"HTTP/1.1 100 Continue\r\n\r\n"
    # Closing sends what is held first.
    writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    writer.close()
    assert transport.sends[-1] == b"HTTP/1.1 204 No Content\r\n\r\n" and transport.closed


async def test_head_and_streamed_answers_arrive_whole_over_the_wire() -> None:
    async with gateway() as (root, _):
        async with httpx.AsyncClient(base_url=root) as client:
            head = await client.head("/health/live")
            health = await client.get("/health/live")
            async with client.stream("GET", "/health/live") as streamed:
                body = await streamed.aread()
    assert head.status_code in (200, 405) and head.content == b""
    assert health.status_code == 200 and health.json()["status"] == "alive"
    assert body == health.content


async def _bodies_received(protocol_class: Any, pieces: list[bytes]) -> list[bytes]:
    """The bodies an ASGI app's ``receive`` gets when a request's bytes come in
    ``pieces`` (the app reading after each piece, then after all)."""
    received: list[bytes] = []
    done = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            received.append(message["body"])
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        done.set()

    config = Config(app=app, http="httptools", lifespan="off")
    config.load()
    keywords: dict[str, Any] = {}
    if protocol_class is LimitedHttpToolsProtocol:
        keywords["policy"] = limited_protocol(ConnectionLimits()).keywords["policy"]
    protocol = protocol_class(
        config=config, server_state=ServerState(), app_state={},
        _loop=asyncio.get_running_loop(), **keywords,
    )  # fmt: skip
    protocol.connection_made(RecordingTransport())
    for piece in pieces:
        protocol.data_received(piece)
        await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), 5)
    protocol.connection_lost(None)
    return received


async def test_a_body_is_received_as_uvicorns_own_protocol_receives_it() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n\r\n"
    request = head % len(body) + body
    splits = [[request], [request[:60], request[60:]], [request[:200], request[200:3000]]]
    splits[-1].append(request[3000:])
    splits.append([request[i : i + 700] for i in range(0, len(request), 700)])
    for pieces in splits:
        ours = await _bodies_received(LimitedHttpToolsProtocol, pieces)
        uvicorns = await _bodies_received(HttpToolsProtocol, pieces)
        assert ours == uvicorns and b"".join(ours) == body
        assert all(type(b) is bytes for b in ours)


async def test_a_body_piece_is_held_as_it_came_and_later_ones_join_it() -> None:
    config = Config(app=lambda scope, receive, send: None, http="httptools")
    config.load()
    protocol = LimitedHttpToolsProtocol(
        config=config, server_state=ServerState(), app_state={},
        _loop=asyncio.get_running_loop(),
        policy=limited_protocol(ConnectionLimits()).keywords["policy"],
    )  # fmt: skip
    protocol.connection_made(RecordingTransport())
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: g\r\nContent-Length: 6\r\n\r\n")
    first, second = b"abc", b"def"
    protocol.on_body(first)
    assert protocol.cycle.body is first  # no copy: uvicorn's receive hands it over as is
    protocol.on_body(second)
    assert protocol.cycle.body == bytearray(b"abcdef")
    protocol.connection_lost(None)
