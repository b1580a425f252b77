"""OpenAI Responses requests as the engine's chat request: every field's handling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout_gateway.server.dialects import RequestError, ResponsesDialect

FIXTURES = Path(__file__).parent / "fixtures"


def parse(**body: Any) -> Any:
    return ResponsesDialect().parse({"model": "m", "input": "hi", **body})


def test_codexs_request_becomes_chat() -> None:
    body = json.loads((FIXTURES / "codex_after_tool.json").read_text())["body"]
    parsed = ResponsesDialect().parse(body)
    roles = [m["role"] for m in parsed.messages]
    assert roles == ["system", "system", "user", "user", "assistant", "tool"]  # 2 developer
    assert len(parsed.messages[1]["content"]) == 2  # text parts stay a list
    answer = parsed.messages[4]
    assert answer["content"] == "Writing it."
    assert answer["reasoning_content"] == "I should write the file.\nThinking hard."
    assert "reasoning_details" not in answer  # no encrypted content, no phase: nothing kept
    (call,) = answer["tool_calls"]
    assert call == {
        "id": "call_1",
        "type": "function",
        "function": {
            "name": "exec_command",
            "arguments": '{"cmd": "echo hello > out.txt && cat out.txt"}',
        },
    }
    assert parsed.messages[5]["tool_call_id"] == "call_1"
    names = [t["function"]["name"] for t in parsed.body["tools"]]
    assert names[:4] == ["exec_command", "write_stdin", "request_user_input", "view_image"]
    assert parsed.body["tools"][4]["function"]["namespace"] == "multi_agent_v1"
    assert parsed.facts["dropped_tools"] == ["web_search"]
    assert parsed.facts["ignored_fields"] == [
        "client_metadata",
        "include",
        "prompt_cache_key",
        "store",
    ]
    assert parsed.body["tool_choice"] == "auto" and parsed.body["parallel_tool_calls"] is True


def test_state_the_chat_shape_lacks_is_kept() -> None:
    items = [
        {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "blob"},
        {"type": "message", "role": "assistant", "phase": "final", "content": "x"},
        {"type": "local_shell_call", "call_id": "c", "action": {}},
        {"role": "user", "content": "next"},
    ]
    parsed = parse(input=items)
    kept = parsed.messages[0]["reasoning_details"]
    assert [item.get("type") for item in kept] == ["reasoning", "message", "local_shell_call"]


def test_outputs_of_every_shape() -> None:
    items = [
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "b", "name": "g", "input": "raw"},
        {"type": "function_call_output", "call_id": "a", "output": {"ok": True}},
        {
            "type": "custom_tool_call_output",
            "call_id": "b",
            "output": [{"type": "input_text", "text": "t"}],
        },
    ]
    parsed = parse(input=items)
    calls = parsed.messages[0]["tool_calls"]
    assert calls[1] == {"id": "b", "type": "custom", "custom": {"name": "g", "input": "raw"}}
    assert parsed.messages[1] == {"role": "tool", "tool_call_id": "a", "content": '{"ok": true}'}
    assert parsed.messages[2]["content"] == [{"type": "text", "text": "t"}]


def test_format_max_tokens_and_tool_choice() -> None:
    fmt = {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}
    parsed = parse(
        text={"format": fmt}, max_output_tokens=50, tool_choice={"type": "function", "name": "f"}
    )
    assert parsed.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert parsed.body["max_tokens"] == 50
    assert parsed.body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    hosted = parse(tool_choice={"type": "web_search"})
    assert "tool_choice" not in hosted.body and hosted.facts["ignored_tool_choice"] == "web_search"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": [3]}, "input[0]"),
        ({"instructions": ["x"]}, "instructions"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input[0].content[0].image_url"),
        ({"stream": 1}, "stream"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"tool_choice": 5}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_or_stateful_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(**body)
    assert caught.value.param == param


def test_no_silent_fresh_start() -> None:
    """A continuation the gateway cannot honour is refused, never answered from nothing."""
    with pytest.raises(RequestError) as caught:
        parse(previous_response_id="resp_1", input=[{"role": "user", "content": "and then?"}])
    assert caught.value.code == "unsupported_parameter"
    assert parse(previous_response_id=None, background=False).messages  # nulls are fine
