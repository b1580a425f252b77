"""A turn's recorded messages mean to verifiers v1 what the native request means to v1's
own dialect parser (verifiers 0.4.0 only).

For real Claude Code and Codex requests (``fixtures/``) and requests built with the
official SDKs, two v1 traces of one turn are compared:

- v1's own interception: ``AnthropicDialect`` / ``ResponsesDialect.parse_request`` of the
  native request, ``graph.prepare_turn`` and ``commit`` of v1's own parse of the
  dialect's answer (the gateway's rendered answer, as a provider's);
- the gateway's: the dialect adapter's chat messages and tools, recorded with the
  engine's assistant message as ``Dialect.recorded_answer`` gives it, replayed into a
  trace by the v1 adapter (``rollout_gateway.v1.trace_sync.TraceSync``, which reads
  chat messages with v1's chat dialect).

The branches must hold the same messages by v1's own identity (``graph.message_hash``:
what makes two messages one node), the same text, reasoning, tool calls and tool-result
ids, and the same client tools. Known differences, by design: a tool message's ``name``
(v1's chat reading fills it in from the call it answers; v1's Anthropic and Responses
parsers leave it empty; it is not part of a message's identity), and a Responses
assistant message's ``provider_state`` lists only the items that carry state (v1 keeps
every item of the run, and its hash reads only those).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import orjson
import pytest
import verifiers.v1 as vf
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.dialects import AnthropicDialect as V1Anthropic
from verifiers.v1.dialects import ResponsesDialect as V1Responses
from verifiers.v1.graph import message_hash, prepare_turn
from verifiers.v1.task import TaskData
from verifiers.v1.trace import AgentInfo, TraceTask

from rollout_gateway.server.dialects import AnthropicDialect, Dialect, ResponsesDialect
from rollout_gateway.server.engines.upstream_request import assistant_message
from rollout_gateway.v1.trace_sync import TraceSync

from .support import engine_chunks, fold

FIXTURES = Path(__file__).parent / "fixtures"
HOSTED = frozenset({"web_search", "file_search", "mcp", "code_interpreter", "image_generation"})


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())["body"]


def _sdk_body(send: Any, http: Any) -> dict[str, Any]:
    """The JSON body an official SDK sends for ``send(client)``."""
    sent: list[bytes] = []

    def handler(request: Any) -> Any:
        sent.append(request.read())
        return http.Response(500, json={"error": {"message": "captured"}})

    send(http.Client(transport=http.MockTransport(handler)))
    return orjson.loads(sent[0])


def _anthropic_sdk(**params: Any) -> dict[str, Any]:
    def send(http_client: Any) -> None:
        client = anthropic.Anthropic(api_key="k", http_client=http_client, max_retries=0)
        with pytest.raises(anthropic.InternalServerError):
            client.messages.create(model="m", max_tokens=64, **params)

    return _sdk_body(send, httpx2)


def _openai_sdk(**params: Any) -> dict[str, Any]:
    def send(http_client: Any) -> None:
        client = openai.OpenAI(api_key="k", http_client=http_client, max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.responses.create(model="m", **params)

    return _sdk_body(send, httpx)


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M/wHwAF/gL+Xw4AAAAASUVORK5CYII="


def anthropic_requests() -> dict[str, dict[str, Any]]:
    call = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls -la"}}
    return {
        "claude_code_first_turn": _fixture("claude_code_first_turn.json"),
        "claude_code_after_tool": _fixture("claude_code_after_tool.json"),
        "claude_code_non_streamed": _fixture("claude_code_non_streamed.json"),
        "sdk_multimodal_and_results": _anthropic_sdk(
            system="You are terse.",
            tools=[
                {"name": "Bash", "input_schema": {"type": "object"}},
                {"type": "web_search_20250305", "name": "web_search"},
            ],
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                        },
                        {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
                    ],
                },
                {"role": "assistant", "content": "A dot. Checking the files."},
                {"role": "user", "content": "go on"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                        {"type": "text", "text": "Running ls."},
                        call,
                        {**call, "id": "toolu_2", "input": {"command": "pwd", "n": "é"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": "a.txt"},
                                {"type": "text", "text": "b.txt"},
                            ],
                        },  # fmt: skip
                        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True},
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ],
        ),
    }


def responses_requests() -> dict[str, dict[str, Any]]:
    return {
        "codex_first_turn": _fixture("codex_first_turn.json"),
        "codex_after_tool": _fixture("codex_after_tool.json"),
        "sdk_string_input": _openai_sdk(instructions="Be brief.", input="hello"),
        "sdk_items": _openai_sdk(
            tools=[
                {"type": "function", "name": "run", "parameters": {"type": "object"}},
                {"type": "custom", "name": "apply_patch", "description": "patch"},
                {"type": "web_search"},
            ],
            input=[
                {"role": "developer", "content": "Use tools."},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {
                            "type": "input_image",
                            "image_url": "https://x.test/a.png",
                            "detail": "auto",
                        },
                    ],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "plan"}],
                    "encrypted_content": "opaque-blob",
                },
                {"type": "function_call", "call_id": "c1", "name": "run", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "ran"},
                {
                    "type": "custom_tool_call",
                    "call_id": "c2",
                    "name": "apply_patch",
                    "input": "*** Begin",
                },
                {
                    "type": "custom_tool_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "patched"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Done", "annotations": []}],
                },
                {"role": "user", "content": "thanks"},
            ],
        ),
    }


def new_trace() -> vf.Trace:
    return vf.Trace(
        task=TraceTask(type="T", data=TaskData(prompt="p")),
        agent=AgentInfo(config=AgentConfig(model="m")),
    )


ANSWER = engine_chunks(
    reasoning=["Thinking ", "it over."],
    content=["Here."],
    calls=[("call_9", "Bash", ['{"command": ', '"ls"}'])],
    finish="tool_calls",
)


def v1_own_trace(v1_dialect: Any, body: dict[str, Any], answer: dict[str, Any]) -> vf.Trace:
    """The trace v1's own interception records for this turn and answer."""
    trace = new_trace()
    request = v1_dialect.parse_request(body)
    response = v1_dialect.parse_response(v1_dialect.validate_response(answer))
    prepare_turn(trace, request.messages, request.tools).commit(response)
    return trace


def gateway_trace(dialect: Dialect, body: dict[str, Any], completion: dict[str, Any]) -> vf.Trace:
    """The trace the v1 adapter rebuilds from the gateway's record of this turn."""
    parsed = dialect.parse(body)
    engine_message = completion["choices"][0]["message"]
    recorded = dialect.recorded_answer(assistant_message(engine_message), parsed)
    step = {
        "prompt": orjson.loads(parsed.messages_text),  # as stored: the JSON the engine got
        "completion": [recorded],
        "tokens": None,
        "is_truncated": False,
        "extras": {"tools": parsed.body.get("tools") or [], "finish_reason": "tool_calls"},
    }
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply({"trajectory": [step]})
    return trace


def _call(call: Any) -> tuple[Any, ...]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    return (call.id, call.type, call.name, call.namespace, arguments)


def _meaning(message: Any) -> tuple[Any, ...]:
    """What a message says, by field (the identity v1 keys its graph on first)."""
    fields: tuple[Any, ...] = (message_hash(message), message.role, message.content)
    if message.role == "assistant":
        calls = [_call(c) for c in message.tool_calls or ()]
        fields += (message.reasoning_content, calls)
    if message.role == "tool":
        fields += (message.tool_call_id,)
    return fields


def _tools(trace: vf.Trace) -> list[tuple[Any, ...]]:
    tools = trace.branches[0].tools
    return [
        (t.type, t.name, t.namespace, t.description, t.parameters, t.strict)
        for t in tools
        if t.type in ("function", "custom")
    ]


def assert_same_meaning(own: vf.Trace, gateway: vf.Trace) -> None:
    own_messages = own.branches[0].messages
    gateway_messages = gateway.branches[0].messages
    assert len(gateway_messages) == len(own_messages)
    for mine, theirs in zip(gateway_messages, own_messages, strict=True):
        assert _meaning(mine) == _meaning(theirs)
    assert _tools(gateway) == _tools(own)
    assert own.num_branches == gateway.num_branches == 1


@pytest.mark.parametrize("name", sorted(anthropic_requests()))
def test_anthropic_turn_means_what_v1s_parser_makes_of_it(name: str) -> None:
    body = anthropic_requests()[name]
    completion = fold(ANSWER)
    dialect = AnthropicDialect()
    rendered = dialect.render(completion, dialect.parse(body))
    own = v1_own_trace(V1Anthropic(), body, orjson.loads(orjson.dumps(rendered)))
    assert_same_meaning(own, gateway_trace(dialect, body, completion))


@pytest.mark.parametrize("name", sorted(responses_requests()))
def test_responses_turn_means_what_v1s_parser_makes_of_it(name: str) -> None:
    body = responses_requests()[name]
    completion = fold(ANSWER)
    dialect = ResponsesDialect()
    rendered = dialect.render(completion, dialect.parse(body))
    own = v1_own_trace(V1Responses(), body, orjson.loads(orjson.dumps(rendered)))
    assert_same_meaning(own, gateway_trace(dialect, body, completion))


def test_the_echoed_answer_extends_the_recorded_turn_as_one_branch() -> None:
    """Claude Code's next request echoes the answer (its thinking block too): v1 places
    the echo on the recorded answer's node, so the rollout stays one branch."""
    first = _fixture("claude_code_first_turn.json")
    dialect = AnthropicDialect()
    completion = fold(ANSWER)
    parsed = dialect.parse(first)
    answer = orjson.loads(orjson.dumps(dialect.render(completion, parsed)))
    echo = {"role": "assistant", "content": answer["content"]}
    result = {"type": "tool_result", "tool_use_id": "call_9", "content": "a.txt"}
    second = {
        **first,
        "messages": [*first["messages"], echo, {"role": "user", "content": [result]}],
    }
    recorded = dialect.recorded_answer(
        assistant_message(completion["choices"][0]["message"]), parsed
    )
    next_turn = dialect.parse(second)
    trace = new_trace()
    steps = [
        {"prompt": parsed.messages, "completion": [recorded], "tokens": None, "extras": {}},
        {"prompt": next_turn.messages, "completion": [{"role": "assistant", "content": "ok"}],
         "tokens": None, "extras": {}},
    ]  # fmt: skip
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply({"trajectory": steps})
    assert trace.num_branches == 1 and trace.num_turns == 2
