"""Anthropic Messages requests as the engine's chat request: every field's handling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout_gateway.server.dialects import AnthropicDialect, RequestError

FIXTURES = Path(__file__).parent / "fixtures"


def parse(**body: Any) -> Any:
    base = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    return AnthropicDialect().parse({**base, **body})


def test_claude_codes_request_becomes_chat() -> None:
    body = json.loads((FIXTURES / "claude_code_after_tool.json").read_text())["body"]
    parsed = AnthropicDialect().parse(body)
    roles = [m["role"] for m in parsed.messages]
    # system blocks; the prompt; Claude Code's mid-conversation system turn (read as a
    # user turn, as v1 reads it); the answer; its Bash result.
    assert roles == ["system", "user", "user", "assistant", "tool"]
    system = parsed.messages[0]["content"]
    assert [set(part) for part in system] == [{"type", "text"}] * 3  # cache_control dropped
    assert isinstance(parsed.messages[2]["content"], str)  # one text block: its text
    answer = parsed.messages[3]
    assert (
        answer["content"] == "Writing it."
        and answer["reasoning_content"] == "I should write the file."
    )
    assert answer["reasoning_details"] == [
        {"type": "thinking", "thinking": "I should write the file.", "signature": ""}
    ]
    (call,) = answer["tool_calls"]
    assert call["id"] == "toolu_01" and call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"])["command"].startswith("echo hello")
    assert parsed.messages[4] == {"role": "tool", "tool_call_id": "toolu_01", "content": "hello"}
    assert len(parsed.body["tools"]) == 12 and parsed.body["max_tokens"] == 32000
    assert parsed.stream is True
    assert parsed.facts["ignored_fields"] == ["context_management", "metadata"]
    assert set(parsed.facts["agent_sampling"]) == {"max_tokens", "thinking", "output_config"}


def test_tool_results_come_before_the_rest_of_a_user_turn() -> None:
    content = [
        {"type": "text", "text": "see:"},
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}]},
        {"type": "tool_result", "tool_use_id": "t2"},
        {"type": "document", "source": {"type": "text", "data": "doc"}},
    ]
    parsed = parse(messages=[{"role": "user", "content": content}])
    assert parsed.messages == [
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        {"role": "tool", "tool_call_id": "t2", "content": []},
        {"role": "user", "content": [{"type": "text", "text": "see:"}]},
    ]
    assert parsed.facts["dropped_content"] == ["document"]


def test_images_become_image_url_parts() -> None:
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://x.test/i.png"}},
    ]
    parsed = parse(messages=[{"role": "user", "content": content}])
    assert parsed.messages[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
        {"type": "image_url", "image_url": {"url": "https://x.test/i.png"}},
    ]
    with pytest.raises(RequestError) as caught:
        file_source = {"type": "image", "source": {"type": "file", "file_id": "f"}}
        parse(messages=[{"role": "user", "content": [file_source, file_source]}])
    assert caught.value.param == "messages[0].content[0].source.type"


def test_tools_and_tool_choice() -> None:
    tools = [
        {"name": "Read", "input_schema": {"type": "object"}, "cache_control": {"type": "x"}},
        {"type": "custom", "name": "Write", "description": "d", "input_schema": {}},
        {"type": "web_search_20250305", "name": "web_search"},
        {"type": "bash_20250124", "name": "bash"},
    ]
    parsed = parse(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert parsed.body["tools"] == [
        {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "Write", "description": "d", "parameters": {}}},
    ]
    assert parsed.facts["dropped_tools"] == ["bash", "web_search"]
    assert (parsed.body["tool_choice"], parsed.body["parallel_tool_calls"]) == ("required", False)
    named = parse(tools=tools, tool_choice={"type": "tool", "name": "Read"}).body["tool_choice"]
    assert named == {"type": "function", "function": {"name": "Read"}}
    assert parse(tool_choice={"type": "none"}).body["tool_choice"] == "none"


def test_stop_sequences_and_output_format() -> None:
    schema = {"type": "object"}
    parsed = parse(stop_sequences=["END"], output_format={"type": "json_schema", "schema": schema})
    assert parsed.body["stop"] == ["END"]
    assert parsed.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": 3}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"tools": {"name": "x"}}, "tools"),
        ({"tools": [{"input_schema": {}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "maybe"}}, "tool_choice.type"),
        ({"mcp_servers": [{"url": "https://mcp"}]}, "mcp_servers"),
        ({"container": "c1"}, "container"),
    ],
)
def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(**body)
    assert caught.value.param == param
    assert caught.value.as_error().status == 400


def test_count_tokens_needs_no_max_tokens_and_never_streams() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    parsed = AnthropicDialect().parse_count(body)
    assert parsed.stream is False and "max_tokens" not in parsed.body
