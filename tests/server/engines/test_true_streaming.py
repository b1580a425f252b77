"""True streaming from vLLM, replayed from chunks recorded off the real vLLM 0.32.

``fixtures/vllm-0.32-*.json`` hold a request (``return_token_ids``, ``logprobs``,
temperature 0) and vLLM's whole answer to it; ``*-stream.sse`` the raw SSE vLLM sent
for the same request with ``stream: true`` (captured from a real vLLM: ``tools/real-vllm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.server.engines.answers import read_answer
from rollout_gateway.server.engines.streaming import (
    EventLog,
    StreamAssembler,
    StreamError,
    iter_sse_json,
    sse_event,
)

from ..conftest import GatewayFactory

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    data = json.loads((FIXTURES / f"vllm-0.32-{name}.json").read_text())
    raw = (FIXTURES / f"vllm-0.32-{name}-stream.sse").read_text()
    return data["request"], data["answer"], raw


class _ClosingResponse(StreamingResponse):
    """Sets ``closed`` when the response ends, finished or cut by a disconnect."""

    def __init__(self, content: Any, closed: asyncio.Event, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.closed = closed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.closed.set()


class ReplayVLLM:
    """A vLLM-shaped upstream replaying recorded answers.

    ``hold`` (an event) pauses the stream after its first chunk until set, to test
    keepalives and disconnects; ``closed`` is set when the gateway stops reading.
    """

    def __init__(self, name: str, hold: asyncio.Event | None = None) -> None:
        self.request, self.answer, self.raw = fixture(name)
        self.hold = hold
        self.bodies: list[dict[str, Any]] = []
        self.closed = asyncio.Event()

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.bodies.append(body)
            if not body.get("stream"):
                return JSONResponse(self.answer)

            async def events() -> AsyncIterator[bytes]:
                for i, block in enumerate(self.raw.split("\n\n")):
                    if not block.strip():
                        continue
                    yield (block + "\n\n").encode()
                    if i == 0 and self.hold is not None:
                        await self.hold.wait()

            return _ClosingResponse(events(), self.closed, media_type="text/event-stream")

        async def models(request: Request) -> Response:
            card = {"id": "gemma3-270m", "owned_by": "vllm", "max_model_len": 4096}
            return JSONResponse({"object": "list", "data": [card]})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )


def sdk(gw: Any, rollout_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://gateway/v1/rollouts/{rollout_id}",
        api_key=gw.keys[rollout_id],
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(gw.app)),
        max_retries=0,
    )


async def _body(text: str | bytes, size: int = 0) -> AsyncIterator[bytes]:
    """The body's bytes as an upstream hands them over: in pieces of ``size`` bytes
    (``0``: whole)."""
    raw = text.encode() if isinstance(text, str) else text
    size = size or len(raw)
    for at in range(0, len(raw), size):
        yield raw[at : at + size]


@pytest.mark.parametrize("name", ["text", "tool"])
async def test_assembled_stream_equals_the_whole_answer(name: str) -> None:
    _, whole, raw = fixture(name)
    assembler = StreamAssembler()
    async for chunk in iter_sse_json(_body(raw)):
        assembler.feed(chunk)
    assert assembler.finished
    streamed, direct = read_answer(assembler.completion()), read_answer(whole)
    # The prompt's ids stay text (the recorder reads what is new of it), never parsed.
    assert streamed.prompt_ids is None and streamed.prompt_ids_json is not None
    assert orjson.loads(streamed.prompt_ids_json) == direct.prompt_ids
    s, d = streamed.first, direct.first
    assert s is not None and d is not None
    assert s.completion_ids == d.completion_ids
    assert s.completion_logprobs == pytest.approx(d.completion_logprobs, abs=1e-4)
    assert len(s.completion_logprobs or []) == len(s.completion_ids or [])
    assert (s.finish_reason, s.stop_reason) == (d.finish_reason, d.stop_reason)
    assert s.message.get("content") == d.message.get("content")
    calls = [c["function"] for c in s.message.get("tool_calls") or ()]
    assert calls == [c["function"] for c in d.message.get("tool_calls") or ()]
    assert streamed.usage is not None and streamed.usage["completion_tokens"] == len(
        d.completion_ids or []
    )


@pytest.mark.parametrize("name", ["text", "tool"])
async def test_gateway_streams_from_vllm_and_records_the_whole_turn(
    make_gateway: GatewayFactory, name: str
) -> None:
    engine = ReplayVLLM(name)
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="gemma3-270m")
    request = engine.request
    stream = await sdk(gw, "r1").chat.completions.create(
        model="agent",
        messages=request["messages"],
        tools=request.get("tools") or openai.NOT_GIVEN,
        stream=True,
        logprobs=True,
    )
    logprobs, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                logprobs += [e.logprob for e in choice.logprobs.content]
            finish = choice.finish_reason or finish
    sent = engine.bodies[0]
    assert sent["stream"] is True and sent["return_token_ids"] is True and sent["logprobs"]
    assert sent["stream_options"] == {"include_usage": True}
    whole = engine.answer["choices"][0]
    assert len(logprobs) == len(whole["token_ids"])  # the agent asked for logprobs: all of them
    assert finish == whole["finish_reason"]

    step = (await gw.trajectory("r1")).json()["trajectory"][0]
    assert step["tokens"]["prompt_ids"] == engine.answer["prompt_token_ids"]
    assert step["tokens"]["completion_ids"] == whole["token_ids"]
    assert step["tokens"]["completion_logprobs"] == pytest.approx(
        [e["logprob"] for e in whole["logprobs"]["content"]], abs=1e-4
    )
    assert step["extras"]["usage"]["completion_tokens"] == len(whole["token_ids"])
    assert step["extras"]["timing"]["first_token_s"] is not None
    # Delivered and nobody follows it: the turn's chunks are not kept.
    assert gw.gateway.registry.get("r1").turns.last.events.events == []


async def test_agent_gets_no_ids_or_usage_it_did_not_ask_for(make_gateway: GatewayFactory) -> None:
    engine = ReplayVLLM("text")
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="gemma3-270m")
    body = {"model": "a", "messages": engine.request["messages"], "stream": True}
    headers = gw.agent_headers("r1")
    url = "/v1/rollouts/r1/chat/completions"
    async with gw.client.stream("POST", url, json=body, headers=headers) as r:
        raw = (await r.aread()).decode()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert raw.rstrip().endswith("data: [DONE]")
    assert all("prompt_token_ids" not in c and "usage" not in c for c in chunks)
    assert all(
        ch.get("logprobs") is None and "token_ids" not in ch for c in chunks for ch in c["choices"]
    )
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == engine.answer["choices"][0]["message"]["content"]


ADMIN = "test-admin-token-0123456789"


@contextlib.asynccontextmanager
async def served_pair(engine: ReplayVLLM, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The fake engine and the gateway on loopback sockets (httpx's ASGI transport
    buffers whole responses, which would hide streaming). The client is the admin's."""
    async with running_server(engine.app()) as engine_root:
        gateway_config = GatewayConfig.from_fields(
            upstreams=[f"{engine_root}/v1"], admin_token=ADMIN, **config
        )
        app = create_app(gateway_config)
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with (
            running_server(app) as root,
            httpx.AsyncClient(base_url=root, headers=headers) as client,
        ):
            yield client


async def register(client: httpx.AsyncClient) -> dict[str, str]:
    """Register rollout r1; the agent's headers (its key)."""
    r = await client.post("/v1/rollouts/r1/register", json={"model": "gemma3-270m"})
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


async def test_keepalives_while_the_engine_is_silent() -> None:
    hold = asyncio.Event()
    engine = ReplayVLLM("text", hold=hold)
    body = {"model": "a", "messages": engine.request["messages"], "stream": True}
    async with served_pair(engine, stream_keepalive_s=0.05) as client:
        agent = await register(client)
        seen = b""
        url = "/v1/rollouts/r1/chat/completions"
        async with client.stream("POST", url, json=body, headers=agent) as r:
            assert r.status_code == 200
            async for piece in r.aiter_bytes():
                seen += piece
                if seen.count(b": keepalive") >= 2:
                    hold.set()  # the engine speaks again
        assert b"data: [DONE]" in seen
        assert seen.index(b": keepalive") > seen.index(b"data: ")  # first chunk at once
        step = (await client.get("/v1/rollouts/r1/trajectory")).json()["trajectory"][0]
    assert step["tokens"]["completion_ids"] == engine.answer["choices"][0]["token_ids"]


async def test_agent_disconnect_mid_stream_keeps_the_turn_for_its_retry() -> None:
    hold = asyncio.Event()
    engine = ReplayVLLM("text", hold=hold)
    body = {"model": "a", "messages": engine.request["messages"], "stream": True}
    url = "/v1/rollouts/r1/chat/completions"
    async with served_pair(engine, stream_keepalive_s=0.05) as client:
        agent = await register(client)
        async with client.stream("POST", url, json=body, headers=agent) as r:
            async for _ in r.aiter_bytes():
                break  # the agent goes away after the first bytes
        hold.set()  # the engine finishes: the turn is recorded all the same
        # The SDK's retry joins the turn and gets the whole answer, from the first chunk.
        retry = {**agent, "x-stainless-retry-count": "1"}
        async with client.stream("POST", url, json=body, headers=retry) as r:
            raw = (await r.aread()).decode()
        traj = (await client.get("/v1/rollouts/r1/trajectory")).json()
    assert len(engine.bodies) == 1  # one engine call
    chunks = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == engine.answer["choices"][0]["message"]["content"]
    assert raw.rstrip().endswith("data: [DONE]")
    assert traj["num_turns"] == 1 and traj["abandoned_turns"] == 0
    step = traj["trajectory"][0]
    assert step["tokens"]["completion_ids"] == engine.answer["choices"][0]["token_ids"]


async def stream_after_first_chunk(
    make_gateway: GatewayFactory, tail: str
) -> tuple[Any, list[dict[str, Any]], str]:
    """Stream a turn whose engine sends its first recorded chunk, then ``tail``; the
    gateway harness, the agent's JSON events and its raw stream."""
    engine = ReplayVLLM("text")
    first_block = engine.raw.split("\n\n")[0]
    engine.raw = f"{first_block}\n\n{tail}"
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="gemma3-270m")
    body = {"model": "a", "messages": engine.request["messages"], "stream": True}
    url = "/v1/rollouts/r1/chat/completions"
    async with gw.client.stream("POST", url, json=body, headers=gw.agent_headers("r1")) as r:
        assert r.status_code == 200  # the first chunk went out before the error
        raw = (await r.aread()).decode()
    events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
    return gw, events, raw


async def test_an_engine_error_mid_stream_reaches_the_agent_and_records_nothing(
    make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    error = {"error": {"message": "KV cache lost in /srv/vllm", "type": "X", "code": 500}}
    tail = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"
    gw, events, raw = await stream_after_first_chunk(make_gateway, tail)
    # An engine's 5xx in a stream is told like a whole answer's: its status, not its words.
    assert events[-1]["error"]["message"] == "upstream error 500"
    assert "/srv/vllm" not in raw and "KV cache lost in /srv/vllm" in caplog.text
    assert raw.rstrip().endswith("data: [DONE]")
    traj = (await gw.trajectory("r1")).json()
    assert traj["trajectory"] == [] and traj["num_turns"] == 0
    assert traj["failed_turns"][0]["error"]["type"] == "protocol"


@pytest.mark.parametrize(
    "event",
    [
        '{"choices": 5}',
        '{"choices": [{"index": 0, "delta": {"tool_calls": 5}}]}',
        "[" * 5000 + "]" * 5000,
    ],
    ids=["choices-not-a-list", "tool-calls-not-a-list", "nested-too-deep"],
)
async def test_a_malformed_engine_chunk_ends_the_stream_as_an_upstream_error(
    make_gateway: GatewayFactory, event: str
) -> None:
    gw, events, raw = await stream_after_first_chunk(make_gateway, f"data: {event}\n\n")
    assert events[-1]["error"]["code"] == "upstream_error", events[-1]
    assert raw.rstrip().endswith("data: [DONE]")
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 0 and traj["failed_turns"][0]["error"]["type"] == "protocol"
    metrics = (await gw.client.get("/metrics")).text
    assert "rollout_gateway_internal_errors_total 0" in metrics
    assert 'kind="protocol"} 1' in metrics


async def test_sse_parser_reads_what_servers_send() -> None:
    text = ': comment\n\nevent: x\ndata: {"a":\ndata: 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    got = [chunk async for chunk in iter_sse_json(_body(text))]
    assert got == [{"a": 1}, {"b": 2}]


async def test_sse_parser_cuts_the_prompt_ids_out_of_the_line_as_text() -> None:
    first = '{"id":"c","prompt_token_ids":[1, 2,3],"choices":[]}'
    text = f'data:  {first}\n\ndata:{{"b": 2}}\n\ndata: {{"c":\ndata: 3}}\n\ndata: [DONE] \n\n'
    got = [chunk async for chunk in iter_sse_json(_body(text))]
    assert [dict(c) for c in got[1:]] == [{"b": 2}, {"c": 3}]
    ids = got[0]["prompt_token_ids"]
    assert isinstance(ids, orjson.Fragment) and got[0].ids_text == b"[1, 2,3]"
    assert orjson.dumps(got[0]) == b'{"id":"c","prompt_token_ids":[1, 2,3],"choices":[]}'
    # Relayed unchanged as the engine wrote it (the spaces after "data:" are not its data).
    assert [c.payload for c in got] == [first.encode(), b'{"b": 2}', None]
    assert sse_event(got[0]) == f"data: {first}\n\n".encode()
    nested = '{"x":{"prompt_token_ids":[1]},"choices":[]}'  # not the top-level ids: parsed
    (chunk,) = [c async for c in iter_sse_json(_body(f"data: {nested}\n\n"))]
    assert chunk == {"x": {"prompt_token_ids": [1]}, "choices": []} and chunk.ids_text is None


async def test_a_chunk_relayed_as_it_came_is_its_data_framed_as_an_event() -> None:
    # sse_event frames the chunk's line once encoded, not its data cut out first: the
    # same bytes as "data: " + the data + a blank line, whatever the spaces after "data:".
    data = ['{"id":"é 😀 \\u2028","prompt_token_ids":[1,2],"choices":[]}', '{"b": "x"}']
    for line in (f"data: {data[0]}", f"data:{data[1]}", f"data:   {data[0]}", f"data: {data[1]}"):
        (chunk,) = [c async for c in iter_sse_json(_body(f"{line}\n\n"))]
        assert chunk.payload is not None and chunk.payload.decode() in data
        assert sse_event(chunk) == b"".join((b"data: ", chunk.payload, b"\n\n"))
    # A chunk of several data lines (no line of its own) is written again, as before.
    (chunk,) = [c async for c in iter_sse_json(_body('data: {"c":\ndata: 3}\n\n'))]
    assert chunk.payload is None and sse_event(chunk) == b'data: {"c":3}\n\n'


async def test_chunks_are_relayed_as_the_bytes_the_engine_wrote_in_any_pieces() -> None:
    """The agent gets the bytes of each event the engine wrote, however the body was cut
    into reads (a 224 kB first line split across many), whatever its line ends: the
    events' data read in the bytes, never decoded and encoded again."""
    ids = ",".join(str(i % 50_000) for i in range(32_000))
    first = f'{{"id":"c","prompt_token_ids":[{ids}],"choices":[{{"index":0,"delta":{{}}}}]}}'
    text = '{"id":"c","choices":[{"index":0,"delta":{"content":"é 😀 \\u2028"}}]}'
    engine = [f"data: {first}", f"data:{text}", f"data:  {text}", f"data: {text}"]
    for end in ("\n", "\r\n"):
        raw = "".join(f"{line}{end}{end}" for line in engine) + f": keepalive{end}{end}"
        raw += f"data: [DONE]{end}{end}"
        for size in (1, 7, 4096, 65_536, 0):
            got = [c async for c in iter_sse_json(_body(raw, size))]
            assert [sse_event(c) for c in got] == [
                b"data: " + line.split(":", 1)[1].lstrip(" ").encode() + b"\n\n" for line in engine
            ]
            assert got[0].ids_text == f"[{ids}]".encode() and got[0]["choices"]
            assert orjson.loads(orjson.dumps(got[0]))["prompt_token_ids"][-1] == 31_999
            assert [dict(c) for c in got[1:]] == [json.loads(text)] * 3
    # An event that came as a whole read is relayed as that very buffer: not copied.
    event = f"data: {first}\n\n".encode()

    async def one_read() -> AsyncIterator[bytes]:
        yield event

    (chunk,) = [c async for c in iter_sse_json(one_read())]
    assert sse_event(chunk) is event


async def test_data_that_is_not_utf8_is_read_and_relayed_replaced_as_before() -> None:
    # As when the lines were decoded with errors replaced: parsed with U+FFFD, relayed so.
    raw = b'data: {"choices":[{"index":0,"delta":{"content":"a\xffb"}}]}\n\ndata: [DONE]\n\n'
    (chunk,) = [c async for c in iter_sse_json(_body(raw))]
    assert chunk["choices"][0]["delta"]["content"] == "a\ufffdb"
    assert sse_event(chunk) == raw.split(b"\n\n")[0].replace(b"\xff", "\ufffd".encode()) + b"\n\n"
    with pytest.raises(StreamError, match="not JSON"):
        [c async for c in iter_sse_json(_body(b"data: {\xff\n\n"))]


async def test_the_event_log_wakes_every_follower_and_times_out_alone() -> None:
    """Each follower waits on the log: an event or the close wakes all of them at once,
    a silent engine times each out by itself (its keepalive), and a follower cancelled
    while waiting leaves nothing behind for the next event."""
    log = EventLog()
    first, second = (asyncio.ensure_future(log.wait(5.0)) for _ in range(2))
    await asyncio.sleep(0)
    log.append(b"data: 1\n\n")
    assert await first is True and await second is True
    assert await log.wait(0.01) is False  # nothing came: timed out
    abandoned = asyncio.ensure_future(log.wait(5.0))
    await asyncio.sleep(0)
    abandoned.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await abandoned
    assert log._waiters == []
    silent = log.follow(0.01, keepalive=b": keepalive\n\n")
    assert await anext(silent) == b"data: 1\n\n"
    assert await anext(silent) == b": keepalive\n\n"  # the engine is silent
    await silent.aclose()
    follower = log.follow(5.0)
    assert await anext(follower) == b"data: 1\n\n"
    later = asyncio.ensure_future(anext(follower))
    await asyncio.sleep(0)
    log.append(b"data: 2\n\n")
    assert await later == b"data: 2\n\n"
    log.close()
    assert await log.wait(5.0) is True  # closed: at once
    with pytest.raises(StopAsyncIteration):
        await anext(follower)
