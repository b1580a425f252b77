"""The chat dialect is the gateway's chat behaviour as it was: the same parse, answer,
stream and errors, by the same modules."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from rollout_gateway.server.agents.sse import DONE_EVENT, completion_to_sse
from rollout_gateway.server.dialects import ChatDialect, GatewayError, RequestError
from rollout_gateway.server.engines.streaming import agent_chunk, sse_event
from rollout_gateway.server.engines.turn import agent_answer
from rollout_gateway.server.http.responses import error_response

from .support import engine_chunks, fold

CHUNKS = engine_chunks(reasoning=["r"], content=["Hi", "!"], calls=[("c1", "run", ["{}"])])


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_parse_keeps_the_agents_body_and_its_dropped_fields() -> None:
    parsed = ChatDialect().parse(body(stream=True, temperature=0.5, pad="x" * 100))
    assert parsed.body["messages"] == [{"role": "user", "content": "hi"}]
    assert parsed.body["pad"] is None  # the value of a field never read is dropped
    assert parsed.stream is True
    assert parsed.messages_text == orjson.dumps(parsed.messages)
    assert parsed.facts == {"dialect": "chat", "dropped_fields": ["pad", "temperature"]}


@pytest.mark.parametrize(
    "bad",
    [{"model": "m"}, body(messages=[]), body(messages=["x"]), body(stream="false")],
)
def test_bad_requests_are_request_errors(bad: dict[str, Any]) -> None:
    with pytest.raises(RequestError):
        ChatDialect().parse(bad)


@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True, "logprobs": True}])
def test_answer_and_stream_are_the_chat_paths(extra: dict[str, Any]) -> None:
    dialect = ChatDialect()
    parsed = dialect.parse(body(stream=True, stream_options={"include_usage": True}, **extra))
    completion = fold(CHUNKS)
    assert dialect.render(completion, parsed) == agent_answer(completion, parsed.body)
    renderer = dialect.stream(parsed)
    expected = [
        sse_event(c) for c in (agent_chunk(c, parsed.body, include_usage=True) for c in CHUNKS) if c
    ]
    assert [renderer.feed(c) for c in CHUNKS] == expected
    assert renderer.finish(completion) == DONE_EVENT
    answer = agent_answer(completion, parsed.body)
    assert renderer.whole(completion) == b"".join(completion_to_sse(answer, include_usage=True))


def test_errors_are_the_chat_paths() -> None:
    dialect = ChatDialect()
    error = GatewayError(403, "max turns", code="max_turns_reached", error_type="rate_limit_error")
    answer = dialect.error_answer(error)
    expected = error_response(403, "max turns", "rate_limit_error", code="max_turns_reached")
    assert (answer.status, answer.body) == (403, expected.body)
    stream_error = dialect.stream(dialect.parse(body())).error(error)
    assert stream_error.endswith(DONE_EVENT) and b'"code":"max_turns_reached"' in stream_error
