"""Streams are state machines fed chunk by chunk: each delta is out as its chunk arrives."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import pytest

from rollout_gateway.server.dialects import AnthropicDialect, ResponsesDialect
from rollout_gateway.server.dialects.completion import completion_chunks

from .support import KEY, ROLLOUT, CannedEngine, engine_chunks, fold, mock_handler, sse_payloads

ANTHROPIC_ASK = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "x"}]}
RESPONSES_ASK = {"model": "m", "input": "x"}
CHUNKS = engine_chunks(
    reasoning=["think"],
    content=["Hel", "lo"],
    calls=[("call_1", "run", ['{"a"', ": 1}"])],
    finish="tool_calls",
)


def events(data: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    return list(sse_payloads(data))


def test_anthropic_events_follow_the_chunks() -> None:
    dialect = AnthropicDialect()
    renderer = dialect.stream(dialect.parse({**ANTHROPIC_ASK, "stream": True}))
    out = [events(renderer.feed(chunk)) for chunk in CHUNKS]
    assert [name for name, _ in out[0]] == ["message_start"]
    assert out[0][0][1]["message"]["usage"]["input_tokens"] == 7  # the prompt's ids
    assert [name for name, _ in out[1]] == ["content_block_start", "content_block_delta"]
    assert out[1][1][1]["delta"] == {"type": "thinking_delta", "thinking": "think"}
    assert [p["type"] for _, p in out[2]] == [
        "content_block_stop", "content_block_start", "content_block_delta",
    ]  # fmt: skip
    assert out[2][2][1] == {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "text_delta", "text": "Hel"},
    }
    assert [p["delta"]["text"] for _, p in out[3]] == ["lo"]  # one chunk, one event
    start = out[4][1][1]
    assert start["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "run",
        "input": {},
    }
    assert [p["delta"]["partial_json"] for _, p in out[5] + out[6]] == ['{"a"', ": 1}"]
    assert out[7] == [] and out[8] == []  # the finish and the usage wait for finish()
    tail = events(renderer.finish(fold(CHUNKS)))
    assert [name for name, _ in tail] == ["content_block_stop", "message_delta", "message_stop"]
    assert tail[1][1]["delta"]["stop_reason"] == "tool_use"
    assert all(name == payload["type"] for name, payload in tail)


def test_responses_events_follow_the_chunks() -> None:
    dialect = ResponsesDialect()
    renderer = dialect.stream(dialect.parse({**RESPONSES_ASK, "stream": True}))
    out = [events(renderer.feed(chunk)) for chunk in CHUNKS]
    assert [name for name, _ in out[0]] == ["response.created", "response.in_progress"]
    assert [name for name, _ in out[1]] == [
        "response.output_item.added", "response.reasoning_text.delta",
    ]  # fmt: skip
    assert out[1][1][1]["delta"] == "think"
    names = [name for name, _ in out[2]]
    assert names == [
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert out[2][4][1]["delta"] == "Hel" and out[2][4][1]["item_id"] == "msg_abc123"
    assert [p["delta"] for _, p in out[3]] == ["lo"]
    assert out[4][-1][1]["item"]["type"] == "function_call"
    assert [p["delta"] for _, p in out[5] + out[6]] == ['{"a"', ": 1}"]
    tail = events(renderer.finish(fold(CHUNKS)))
    assert tail[-1][0] == "response.completed"
    assert tail[-1][1]["response"]["output"][2]["arguments"] == '{"a": 1}'


@pytest.mark.parametrize("dialect", [AnthropicDialect(), ResponsesDialect()])
def test_an_answer_given_whole_streams_as_its_chunks_would(dialect: Any) -> None:
    ask = ANTHROPIC_ASK if dialect.name == "anthropic" else RESPONSES_ASK
    parsed = dialect.parse({**ask, "stream": True})
    completion = fold(CHUNKS)
    renderer = dialect.stream(parsed)
    expected = b"".join(renderer.feed(c) for c in completion_chunks(completion))
    expected += renderer.finish(completion)
    assert dialect.stream(parsed).whole(completion) == expected


def test_an_answer_given_whole_parses_in_the_sdk() -> None:
    """(token-in mode, engines that cannot stream token ids: the stream of a whole answer)"""
    completion = fold(CHUNKS)
    dialect = AnthropicDialect()
    data = dialect.stream(dialect.parse({**ANTHROPIC_ASK, "stream": True})).whole(completion)
    engine = CannedEngine()

    def handler(request: Any) -> Any:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    client = anthropic.Anthropic(base_url="http://g" + ROLLOUT, api_key=KEY, http_client=http)
    with client.messages.stream(**ANTHROPIC_ASK) as stream:
        final = stream.get_final_message()
    http_whole = httpx2.Client(transport=httpx2.MockTransport(mock_handler(engine, httpx2)))
    engine.chunks = CHUNKS
    whole = anthropic.Anthropic(base_url="http://g" + ROLLOUT, api_key=KEY, http_client=http_whole)
    plain = whole.messages.create(**ANTHROPIC_ASK)
    assert final.model_dump(
        exclude_none=True, exclude={"content": {"__all__": {"parsed_output"}}}
    ) == (plain.model_dump(exclude_none=True))


def test_keepalives_are_each_dialects_own() -> None:
    ping = AnthropicDialect().keepalive
    assert events(ping) == [("ping", {"type": "ping"})]
    assert ResponsesDialect().keepalive.startswith(b":")  # a comment: no event to parse
