"""The official ``anthropic`` SDK against the Messages dialect: answers parse, the stream
helper assembles the non-streamed answer, every error is the SDK's own typed error."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import pytest

from rollout_gateway.server.dialects import GatewayError

from .support import KEY, ROLLOUT, CannedEngine, asgi_app, engine_chunks, mock_handler

BASE = "http://gateway" + ROLLOUT  # what ANTHROPIC_BASE_URL is: the rollout, no /v1
TOOLS = [
    {
        "name": "Bash",
        "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
ASK: dict[str, Any] = {
    "model": "claude-whatever",
    "max_tokens": 1024,
    "messages": [{"role": "user", "content": "list the files"}],
    "tools": TOOLS,
}

ANSWERS = {
    "text": engine_chunks(content=["Hel", "lo", "!"]),
    "thinking_text_tool": engine_chunks(
        reasoning=["Let me ", "look."],
        content=["Listing."],
        calls=[("call_1", "Bash", ['{"comm', 'and": "ls"}'])],
        finish="tool_calls",
    ),
    "two_tools": engine_chunks(
        calls=[("call_a", "Bash", ['{"command": "ls"}']), ("call_b", "Bash", ["{}"])],
        finish="tool_calls",
        cached=3,
    ),
    "cut_short": engine_chunks(content=["a", "b"], finish="length"),
    "stop_string": engine_chunks(content=["done"], stop_reason="</answer>"),
}


def sync_client(engine: CannedEngine, **kw: Any) -> anthropic.Anthropic:
    http = httpx2.Client(transport=httpx2.MockTransport(mock_handler(engine, httpx2)))
    return anthropic.Anthropic(
        base_url=BASE, api_key=kw.pop("api_key", KEY), http_client=http, max_retries=0, **kw
    )


def async_client(engine: CannedEngine, **kw: Any) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(asgi_app(engine)))
    return anthropic.AsyncAnthropic(
        base_url=BASE, api_key=kw.pop("api_key", KEY), http_client=http, max_retries=0, **kw
    )


def dump(message: Any) -> dict[str, Any]:
    return message.model_dump(
        exclude_none=True, exclude={"content": {"__all__": {"parsed_output"}}}
    )


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_stream_helper_assembles_the_non_streamed_answer(name: str) -> None:
    client = sync_client(CannedEngine(chunks=ANSWERS[name]))
    whole = client.messages.create(**ASK)
    with client.messages.stream(**ASK) as stream:
        streamed = stream.get_final_message()
    assert dump(streamed) == dump(whole)


async def test_async_client_gets_blocks_stop_reason_and_usage() -> None:
    engine = CannedEngine(chunks=ANSWERS["thinking_text_tool"])
    client = async_client(engine)
    message = await client.messages.create(**ASK)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool = message.content
    assert thinking.thinking == "Let me look." and thinking.signature == ""
    assert text.text == "Listing."
    assert (tool.id, tool.name, tool.input) == ("call_1", "Bash", {"command": "ls"})
    assert message.stop_reason == "tool_use" and message.id == "msg_abc123"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 6)
    async with client.messages.stream(**ASK) as stream:
        texts = [event.text async for event in stream if event.type == "text"]
        final = await stream.get_final_message()
    assert texts == ["Listing."]
    assert dump(final) == dump(message)


def test_stop_reasons_and_cached_usage() -> None:
    assert sync_client(CannedEngine(ANSWERS["cut_short"])).messages.create(**ASK).stop_reason == (
        "max_tokens"
    )
    stopped = sync_client(CannedEngine(ANSWERS["stop_string"])).messages.create(**ASK)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "</answer>")
    cached = sync_client(CannedEngine(ANSWERS["two_tools"])).messages.create(**ASK)
    assert cached.usage.input_tokens == 4 and cached.usage.cache_read_input_tokens == 3
    assert [b.input for b in cached.content] == [{"command": "ls"}, {}]


def test_disabled_thinking_hides_the_reasoning() -> None:
    client = sync_client(CannedEngine(ANSWERS["thinking_text_tool"]))
    ask = {**ASK, "thinking": {"type": "disabled"}}
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in whole.content] == ["text", "tool_use"]
    assert dump(streamed) == dump(whole)


def test_the_key_may_come_as_x_api_key_or_bearer() -> None:
    engine = CannedEngine()
    assert sync_client(engine).messages.create(**ASK).content[0].text == "Hi"
    bearer = sync_client(engine, api_key=None, auth_token=KEY)
    assert bearer.messages.create(**ASK).content[0].text == "Hi"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        sync_client(engine, api_key="rk-wrong").messages.create(**ASK)
    assert caught.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("status", "code", "error_class", "error_type"),
    [
        (400, "context_length_exceeded", anthropic.BadRequestError, "invalid_request_error"),
        (403, "max_turns_reached", anthropic.PermissionDeniedError, "permission_error"),
        (404, "rollout_not_found", anthropic.NotFoundError, "not_found_error"),
        (413, None, anthropic.ContentTooLargeError, "request_too_large"),
        (429, "too_many_pending_turns", anthropic.RateLimitError, "rate_limit_error"),
        (500, "internal_error", anthropic.InternalServerError, "api_error"),
        (502, None, anthropic.InternalServerError, "api_error"),
        (503, "store_unavailable", anthropic.ServiceUnavailableError, "api_error"),
        (504, None, anthropic.GatewayTimeoutError, "timeout_error"),
    ],
)
def test_each_error_is_the_sdks_typed_error(
    status: int, code: str | None, error_class: type[Exception], error_type: str
) -> None:
    error = GatewayError(status, f"refused ({status})", code=code)
    client = sync_client(CannedEngine(error=error))
    with pytest.raises(error_class) as caught:
        client.messages.create(**ASK)
    assert type(caught.value) is error_class
    body = caught.value.body  # type: ignore[attr-defined]
    assert body["type"] == "error" and body["error"]["type"] == error_type
    assert body["error"]["message"] == f"refused ({status})"
    assert body["error"].get("details", {}).get("error_code") == code


def test_a_refusal_tells_the_sdk_not_to_retry() -> None:
    calls = []
    engine = CannedEngine(
        error=GatewayError(
            403, "max turns", "max_turns_reached", headers={"x-should-retry": "false"}
        )
    )
    handler = mock_handler(engine, httpx2)

    def counting(request: Any) -> Any:
        calls.append(request)
        return handler(request)

    http = httpx2.Client(transport=httpx2.MockTransport(counting))
    client = anthropic.Anthropic(base_url=BASE, api_key=KEY, http_client=http, max_retries=3)
    with pytest.raises(anthropic.PermissionDeniedError):
        client.messages.create(**ASK)
    assert len(calls) == 1


def test_a_bad_request_is_a_bad_request_error_naming_the_field() -> None:
    client = sync_client(CannedEngine())
    bad = {**ASK, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**bad)
    assert "messages[0].content[0].source" in caught.value.body["error"]["message"]


def test_an_error_mid_stream_raises_in_the_stream_helper() -> None:
    engine = CannedEngine(
        chunks=engine_chunks(content=["partial"]),
        stream_error=GatewayError(502, "upstream error 500", code="bad_gateway"),
    )
    client = sync_client(engine)
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(**ASK) as stream:
            stream.get_final_message()
    assert caught.value.body["error"]["message"] == "upstream error 500"


def test_count_tokens_is_answered() -> None:
    engine = CannedEngine()
    count = sync_client(engine).messages.count_tokens(
        model="m", messages=ASK["messages"], tools=TOOLS
    )
    assert count.input_tokens > 0
    assert engine.requests[-1].facts["dialect"] == "anthropic"


def test_the_engine_gets_chat_messages_and_tools() -> None:
    engine = CannedEngine()
    sync_client(engine).messages.create(
        **{**ASK, "system": "be brief", "stop_sequences": ["</a>"]},
        extra_body={"temperature": 0.3},  # (an agent's own sampling field)
    )
    parsed = engine.requests[-1]
    assert parsed.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list the files"},
    ]
    assert parsed.body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "description": "Run a command",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]
    assert (parsed.body["max_tokens"], parsed.body["stop"]) == (1024, ["</a>"])
    assert "temperature" not in parsed.body  # the registered sampling wins
    assert parsed.facts["agent_sampling"]["temperature"] == 0.3
