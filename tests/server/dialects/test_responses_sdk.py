"""The official ``openai`` SDK's ``responses`` API against the Responses dialect (both
stacks' SDKs: classic pins openai 3, v1 gets openai 2): answers parse, the stream helper
assembles the non-streamed answer, every error is the SDK's own typed error."""

from __future__ import annotations

import importlib
from typing import Any

import openai
import orjson
import pytest

from rollout_gateway.server.dialects import GatewayError

from .support import (
    KEY,
    ROLLOUT,
    CannedEngine,
    asgi_app,
    engine_chunks,
    mock_handler,
    respond,
    sse_payloads,
)

#: The HTTP library this openai version is built on (openai 3 uses httpx2, 2 httpx).
_base = importlib.import_module("openai._base_client")
http: Any = getattr(_base, "httpx2", None) or _base.httpx

BASE = "http://gateway" + ROLLOUT  # what OPENAI_BASE_URL is: the rollout's URL
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    },
    {
        "type": "namespace",
        "name": "agents",
        "description": "sub-agents",
        "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
    },
    {"type": "web_search"},
]
ASK: dict[str, Any] = {
    "model": "gpt-whatever",
    "input": [{"role": "user", "content": "list the files"}],
    "tools": TOOLS,
    "store": False,
}

ANSWERS = {
    "text": engine_chunks(content=["Hel", "lo", "!"]),
    "reasoning_text_tool": engine_chunks(
        reasoning=["Let me ", "look."],
        content=["Listing."],
        calls=[("call_1", "exec_command", ['{"cm', 'd": "ls"}'])],
        finish="tool_calls",
    ),
    "namespaced_tool": engine_chunks(calls=[("call_2", "spawn", ["{}"])], finish="tool_calls"),
    "two_tools": engine_chunks(
        calls=[("call_a", "exec_command", ['{"cmd": "ls"}']), ("call_b", "spawn", ["{}"])],
        finish="tool_calls",
        cached=3,
    ),
    "empty": engine_chunks(),
}


def sync_client(engine: CannedEngine, api_key: str = KEY) -> openai.OpenAI:
    client = http.Client(transport=http.MockTransport(mock_handler(engine, http)))
    return openai.OpenAI(base_url=BASE, api_key=api_key, http_client=client, max_retries=0)


def async_client(engine: CannedEngine) -> openai.AsyncOpenAI:
    client = http.AsyncClient(transport=http.ASGITransport(asgi_app(engine)))
    return openai.AsyncOpenAI(base_url=BASE, api_key=KEY, http_client=client, max_retries=0)


def dump(response: Any) -> dict[str, Any]:
    return response.model_dump(exclude_none=True)


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_stream_helper_assembles_the_non_streamed_answer(name: str) -> None:
    client = sync_client(CannedEngine(chunks=ANSWERS[name]))
    whole = client.responses.create(**ASK)
    with client.responses.stream(**ASK) as stream:
        streamed = stream.get_final_response()
    assert dump(streamed) == dump(whole)
    assert whole.status == "completed"


async def test_async_client_gets_items_text_and_usage() -> None:
    client = async_client(CannedEngine(chunks=ANSWERS["reasoning_text_tool"]))
    response = await client.responses.create(**ASK)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.content[0].text == "Let me look." and reasoning.summary == []
    assert response.output_text == "Listing."
    assert (call.call_id, call.name, call.arguments) == ("call_1", "exec_command", '{"cmd": "ls"}')
    assert response.id == "resp_abc123" and message.id == "msg_abc123"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 6)
    async with client.responses.stream(**ASK) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert deltas == ["Listing."]
    assert dump(final) == dump(response)


def test_a_namespaced_tools_call_carries_its_namespace() -> None:
    response = sync_client(CannedEngine(ANSWERS["namespaced_tool"])).responses.create(**ASK)
    (call,) = response.output
    assert (call.name, call.model_dump().get("namespace")) == ("spawn", "agents")


def test_a_cut_answer_is_incomplete_streamed_or_not() -> None:
    chunks = engine_chunks(content=["a", "b"], finish="length")
    whole = sync_client(CannedEngine(chunks)).responses.create(**ASK)
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    # The stream helper wants response.completed (as against OpenAI's own API): the
    # stream ends with response.incomplete carrying the very non-streamed answer.
    answer = respond(CannedEngine(chunks), f"{ROLLOUT}/responses", _auth(), _body(stream=True))
    *_, (name, last) = sse_payloads(answer.content)
    plain = respond(CannedEngine(chunks), f"{ROLLOUT}/responses", _auth(), _body())
    assert name == "response.incomplete"
    assert last["response"] == orjson.loads(plain.body)


def test_events_are_numbered_and_named() -> None:
    engine = CannedEngine(ANSWERS["reasoning_text_tool"])
    answer = respond(engine, f"{ROLLOUT}/responses", _auth(), _body(stream=True))
    events = list(sse_payloads(answer.content))
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    assert all(name == payload["type"] for name, payload in events)
    assert [name for name, _ in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1][0] == "response.completed"


def test_wrong_key_is_an_authentication_error() -> None:
    with pytest.raises(openai.AuthenticationError):
        sync_client(CannedEngine(), api_key="rk-wrong").responses.create(**ASK)


@pytest.mark.parametrize(
    ("status", "code", "error_class"),
    [
        (400, "context_length_exceeded", openai.BadRequestError),
        (403, "max_turns_reached", openai.PermissionDeniedError),
        (404, "rollout_not_found", openai.NotFoundError),
        (429, "too_many_pending_turns", openai.RateLimitError),
        (500, "internal_error", openai.InternalServerError),
        (502, None, openai.InternalServerError),
        (503, "store_unavailable", openai.InternalServerError),
    ],
)
def test_each_error_is_the_sdks_typed_error(
    status: int, code: str | None, error_class: type[Exception]
) -> None:
    client = sync_client(CannedEngine(error=GatewayError(status, "refused", code=code)))
    with pytest.raises(error_class) as caught:
        client.responses.create(**ASK)
    assert type(caught.value) is error_class
    assert caught.value.code == (code or {502: "bad_gateway"}[status])  # type: ignore[attr-defined]


def test_previous_response_id_is_refused_naming_the_field() -> None:
    client = sync_client(CannedEngine())
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**ASK, previous_response_id="resp_earlier")
    assert caught.value.param == "previous_response_id"
    assert caught.value.code == "unsupported_parameter"
    assert "previous_response_id" in caught.value.message


def test_an_error_mid_stream_raises_and_fails_the_response() -> None:
    engine = CannedEngine(
        chunks=engine_chunks(content=["partial"]),
        stream_error=GatewayError(502, "upstream error 500", code="bad_gateway"),
    )
    with pytest.raises(openai.APIError) as caught:
        with sync_client(engine).responses.stream(**ASK) as stream:
            stream.get_final_response()
    assert "upstream error 500" in str(caught.value)
    answer = respond(engine, f"{ROLLOUT}/responses", _auth(), _body(stream=True))
    name, failed = list(sse_payloads(answer.content))[-1]
    assert name == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "bad_gateway", "message": "upstream error 500"}


def test_the_engine_gets_chat_messages_and_function_tools() -> None:
    engine = CannedEngine()
    sync_client(engine).responses.create(
        **{**ASK, "instructions": "be brief", "max_output_tokens": 99, "temperature": 0.2}
    )
    parsed = engine.requests[-1]
    assert parsed.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list the files"},
    ]
    names = [(t["function"]["name"], t["function"].get("namespace")) for t in parsed.body["tools"]]
    assert names == [("exec_command", None), ("spawn", "agents")]
    assert parsed.facts["dropped_tools"] == ["web_search"]
    assert parsed.body["max_tokens"] == 99 and "temperature" not in parsed.body
    assert parsed.facts["agent_sampling"]["temperature"] == 0.2
    assert "store" in parsed.facts["ignored_fields"]


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def _body(**extra: Any) -> bytes:
    return orjson.dumps({**ASK, **extra})
