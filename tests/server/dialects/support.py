"""A tiny gateway of the dialect adapters around a canned engine, for the official SDKs.

:func:`respond` does what the turn runner will do with a dialect (route, key, parse,
answer whole or stream chunk by chunk, errors), minus the engine: the engine is a list
of vLLM-shaped ``chat.completion.chunk`` dicts (:func:`engine_chunks`), folded into the
whole completion by the gateway's own :class:`StreamAssembler` as a streamed turn is.
:func:`asgi_app` serves it to async SDK clients, :func:`mock_handler` to sync ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rollout_gateway.server.dialects import (
    AnthropicDialect,
    Dialect,
    GatewayError,
    ParsedRequest,
    RequestError,
    match_route,
)
from rollout_gateway.server.dialects.anthropic import estimated_input_tokens
from rollout_gateway.server.engines.streaming import StreamAssembler

#: The rollout key the test gateway accepts.
KEY = "rk-" + "k" * 40
ROLLOUT = "/v1/rollouts/r1"


def engine_chunks(
    *,
    reasoning: Sequence[str] = (),
    content: Sequence[str] = (),
    calls: Sequence[tuple[str, str, Sequence[str]]] = (),
    finish: str = "stop",
    stop_reason: Any = None,
    prompt_tokens: int = 7,
    cached: int | None = None,
    completion_id: str = "chatcmpl-abc123",
    model: str = "served-model",
) -> list[dict[str, Any]]:
    """The chunks vLLM streams for an answer (``return_token_ids``, usage asked for):
    the role with the prompt's ids first, reasoning and content piece by piece, each
    tool call's id and name then its argument pieces, the finish, the usage."""
    head = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": model,
    }

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
        return {**head, "choices": [choice]}

    first = chunk({"role": "assistant", "content": ""})
    first["prompt_token_ids"] = list(range(1, prompt_tokens + 1))
    out = [first]
    out += [chunk({"reasoning": piece}) for piece in reasoning]
    out += [chunk({"content": piece}) for piece in content]
    for index, (call_id, name, pieces) in enumerate(calls):
        start = {"index": index, "id": call_id, "type": "function"}
        out.append(chunk({"tool_calls": [{**start, "function": {"name": name, "arguments": ""}}]}))
        for piece in pieces:
            out.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}))
    generated = len(reasoning) + len(content) + sum(len(p) for _, _, p in calls) + 1
    out.append(chunk({}, finish_reason=finish, stop_reason=stop_reason, token_ids=[9] * generated))
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    out.append({**head, "choices": [], "usage": usage})
    return out


def fold(chunks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole completion the chunks add up to (as the gateway records a stream)."""
    assembler = StreamAssembler()
    for chunk in chunks:
        assembler.feed(chunk)
    return assembler.completion()


@dataclass
class CannedEngine:
    """What the test gateway answers: the engine's chunks, or an error before the
    answer (``error``) or after the chunks (``stream_error``)."""

    chunks: list[dict[str, Any]] = field(default_factory=lambda: engine_chunks(content=["Hi"]))
    error: GatewayError | None = None
    stream_error: GatewayError | None = None
    requests: list[ParsedRequest] = field(default_factory=list)


@dataclass
class Answer:
    """An HTTP answer of the test gateway (``events``: an SSE body, piece by piece)."""

    status: int
    body: bytes = b""
    events: list[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def content(self) -> bytes:
        return b"".join(self.events) if self.events is not None else self.body


def _error(dialect: Dialect, error: GatewayError) -> Answer:
    answer = dialect.error_answer(error)
    return Answer(answer.status, answer.body, headers=dict(answer.headers))


def respond(engine: CannedEngine, path: str, headers: dict[str, str], raw: bytes) -> Answer:
    """The test gateway's answer to ``POST path`` (header names lower-case)."""
    route = match_route(path)
    if route is None:
        return Answer(404, b'{"error": "no such route"}')
    dialect = route.dialect
    if dialect.credential(headers.get("authorization"), headers.get("x-api-key")) != KEY:
        wrong = GatewayError(401, "invalid rollout key", error_type="authentication_error")
        return _error(dialect, wrong)
    try:
        body = orjson.loads(raw)
        if route.aux:
            assert isinstance(dialect, AnthropicDialect)
            parsed = dialect.parse_count(body)
        else:
            parsed = dialect.parse(body)
    except RequestError as exc:
        return _error(dialect, exc.as_error())
    engine.requests.append(parsed)
    if route.aux:
        assert isinstance(dialect, AnthropicDialect)
        count = dialect.render_count(estimated_input_tokens(parsed))
        return Answer(200, orjson.dumps(count))
    if engine.error is not None:
        return _error(dialect, engine.error)
    completion = fold(engine.chunks)
    if not parsed.stream:
        return Answer(200, orjson.dumps(dialect.render(completion, parsed)))
    renderer = dialect.stream(parsed)
    events = [out for out in (renderer.feed(chunk) for chunk in engine.chunks) if out]
    if engine.stream_error is not None:
        events.append(renderer.error(engine.stream_error))
    else:
        events.append(renderer.finish(completion))
    return Answer(200, events=events, headers={"content-type": "text/event-stream"})


def asgi_app(engine: CannedEngine) -> Starlette:
    """:func:`respond` as an ASGI app (async SDK clients over an ASGI transport)."""

    async def handle(request: Request) -> Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        answer = respond(engine, request.url.path, headers, await request.body())
        if answer.events is None:
            return Response(
                answer.body, answer.status, answer.headers, media_type="application/json"
            )

        async def events() -> Any:
            for event in answer.events or ():
                yield event

        return StreamingResponse(events(), answer.status, media_type="text/event-stream")

    return Starlette(routes=[Route("/{path:path}", handle, methods=["POST"])])


def mock_handler(engine: CannedEngine, http: Any) -> Any:
    """:func:`respond` as a mock transport's handler (``http``: the SDK's HTTP library,
    ``httpx`` or ``httpx2``)."""

    def handler(request: Any) -> Any:
        headers = {k.lower(): v for k, v in request.headers.items()}
        answer = respond(engine, request.url.path, headers, request.read())
        content_type = "text/event-stream" if answer.events is not None else "application/json"
        return http.Response(
            answer.status,
            headers={"content-type": content_type, **answer.headers},
            content=answer.content,
        )

    return handler


def sse_payloads(data: bytes) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """``(event name, JSON payload)`` of each SSE event in ``data`` (comments skipped)."""
    for block in data.split(b"\n\n"):
        name, payload = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: ") and line != b"data: [DONE]":
                payload = orjson.loads(line[6:])
        if payload is not None:
            yield name, payload
