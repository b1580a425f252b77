"""An Anthropic Messages request as the chat request the engine gets.

The messages are what verifiers v1's own ``AnthropicDialect.parse_request`` makes of the
same request (so a v1 trace rebuilt from the gateway's record equals the one v1's own
interception records; ``tests/server/dialects/test_v1_parity.py`` checks it on real
Claude Code requests), written as chat messages:

- ``system`` (a string or text blocks) -> one system message; a single text block is
  its text, several are text parts (``cache_control`` and other block keys dropped);
- an assistant turn -> one assistant message: its text blocks joined, its ``thinking``
  blocks joined as ``reasoning_content``, each ``tool_use`` a tool call (arguments
  ``json.dumps(input)``, as v1 writes them), every other block (thinking, redacted
  thinking: the per-message state the chat shape has no field for) kept under
  ``reasoning_details`` as v1 keeps it (its ``provider_state``);
- any other turn (``user``, and the mid-conversation ``system`` turns Claude Code sends,
  which v1 also reads as user turns): each ``tool_result`` block a tool message, in
  order, then the other blocks as one user message (text, and images as ``image_url``
  parts: base64 as a data URL, or the URL); other block types (documents, search
  results...) are dropped and named in the step's ``dropped_content``.

Tools: client tools (no ``type``, or ``custom``) become function tools (``input_schema``
the parameters); server and versioned tools (``web_search_*``, ``bash_*``...) run at a
provider, not here: they are not given to the engine and are named in ``dropped_tools``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_gateway.server.dialects.base import ParsedRequest, field_names
from rollout_gateway.server.dialects.errors import RequestError
from rollout_gateway.server.dialects.reading import (
    STATE_FIELD,
    note_facts,
    object_list,
    optional_bool,
    positive_int,
    string_list,
    text,
    typed,
)

#: v1's order for an assistant turn's state blocks (Claude may reorder mixed thinking
#: blocks between an answer and its replay).
_THINKING_ORDER = {"redacted_thinking": 0, "thinking": 1}

#: The agent's sampling fields, recorded as sent (v1's ``AnthropicDialect.sampling_fields``).
SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "service_tier",
        "stop_sequences",
        "thinking",
        "tool_choice",
        "output_config",
    }
)
#: Fields the gateway reads (translated, or recorded as sampling).
_READ_FIELDS = SAMPLING_FIELDS | {
    "model",
    "messages",
    "system",
    "stream",
    "tools",
    "output_format",
}
#: Provider-side execution the gateway cannot honour: a request asking for it is refused.
REFUSED_FIELDS = ("container", "mcp_servers")


@dataclass(frozen=True, slots=True)
class MessagesContext:
    """What the Anthropic renderers need from the request."""

    #: Whether thinking blocks are answered (not when the agent sent
    #: ``thinking: {"type": "disabled"}``; the reasoning is recorded either way).
    show_thinking: bool = True


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> ParsedRequest:
    """``body`` (``POST /v1/messages``, or its ``count_tokens`` with ``count_only``) as
    the chat request the engine gets, with the turn's facts."""
    for key in REFUSED_FIELDS:
        if body.get(key):
            raise RequestError(
                f"'{key}' asks the provider to run tools itself; this gateway serves a model "
                "only (the agent's own tools run in its sandbox)",
                key,
            )
    dropped: list[str] = []
    messages = _conversation(body, dropped)
    chat: dict[str, Any] = {"messages": messages}
    stream = bool(optional_bool(body, "stream")) and not count_only
    chat["stream"] = stream
    dropped_tools: list[str] = []
    tools = _tools(body.get("tools"), dropped_tools)
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    max_tokens = positive_int(body, "max_tokens", required=not count_only)
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    if body.get("stop_sequences") is not None:
        chat["stop"] = string_list(body["stop_sequences"], "stop_sequences")
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    facts: dict[str, Any] = {"dialect": "anthropic"}
    sampling = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    if sampling:
        facts["agent_sampling"] = sampling
    note_facts(
        facts,
        ignored_fields=field_names(body, _READ_FIELDS),
        dropped_tools=dropped_tools,
        dropped_content=dropped,
    )
    thinking = body.get("thinking")
    show = not (isinstance(thinking, dict) and thinking.get("type") == "disabled")
    return ParsedRequest(
        dialect="anthropic",
        body=chat,
        messages=messages,
        messages_text=orjson.dumps(messages),
        stream=stream,
        facts=facts,
        context=MessagesContext(show_thinking=show),
    )


def _conversation(body: dict[str, Any], dropped: list[str]) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if raw is None:
        raise RequestError("'messages' is required", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _content(system, "system", dropped)})
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array", "messages")
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object", where)
        role = message.get("role")
        content = message.get("content")
        if role == "assistant":
            out.append(_assistant(content, f"{where}.content", dropped))
        elif role in ("user", "system"):
            _user_turn(content, f"{where}.content", out, dropped)
        else:
            raise RequestError(f"'{where}.role' must be 'user' or 'assistant'", f"{where}.role")
    return out


def _content(content: Any, where: str, dropped: list[str]) -> str | list[dict[str, Any]]:
    """User-side content: a string, one text block's text, else text and image parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return []
    blocks = object_list(content, where)
    if len(blocks) == 1 and blocks[0].get("type") == "text":
        return text(blocks[0], "text", f"{where}[0]")
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        kind = typed(block, f"{where}[{index}]")
        if kind == "text":
            parts.append({"type": "text", "text": text(block, "text", f"{where}[{index}]")})
        elif kind == "image":
            url = _image_url(block, f"{where}[{index}]")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            dropped.append(kind)
    return parts


def _image_url(block: dict[str, Any], where: str) -> str:
    source = block.get("source")
    if not isinstance(source, dict):
        raise RequestError(f"'{where}.source' must be an object", f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media = text(source, "media_type", f"{where}.source")
        return f"data:{media};base64,{text(source, 'data', f'{where}.source')}"
    if kind == "url":
        return text(source, "url", f"{where}.source")
    raise RequestError(
        f"'{where}.source.type' {kind!r} is not supported here (base64 or url: the gateway "
        "has no file store)",
        f"{where}.source.type",
    )


def _assistant(content: Any, where: str, dropped: list[str]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content or None}
    blocks = object_list(content, where) if content is not None else []
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    state: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        kind = typed(block, f"{where}[{index}]")
        if kind == "text":
            texts.append(text(block, "text", f"{where}[{index}]"))
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"{where}[{index}]"))
        else:
            state.append(block)
            if kind == "thinking":
                thinking.append(text(block, "thinking", f"{where}[{index}]"))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    reasoning = "".join(thinking)
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    if state:
        if len(state) > 1:
            state.sort(key=lambda block: _THINKING_ORDER.get(block["type"], 2))
        message[STATE_FIELD] = state
    return message


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    function: dict[str, Any] = {
        "name": text(block, "name", where),
        # v1 writes the arguments so; the history check compares them canonically.
        "arguments": json.dumps(block.get("input") or {}),
    }
    namespace = block.get("toolset_name")
    if isinstance(namespace, str):
        function["namespace"] = namespace
    return {"id": text(block, "id", where), "type": "function", "function": function}


def _user_turn(content: Any, where: str, out: list[dict[str, Any]], dropped: list[str]) -> None:
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    if content is None:
        return
    rest = []
    for index, block in enumerate(object_list(content, where)):
        if typed(block, f"{where}[{index}]") == "tool_result":
            call_id = text(block, "tool_use_id", f"{where}[{index}]")
            result = _content(block.get("content"), f"{where}[{index}].content", dropped)
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            rest.append(block)
    if rest:
        out.append({"role": "user", "content": _content(rest, where, dropped)})


def _tools(tools: Any, dropped: list[str]) -> list[dict[str, Any]]:
    if tools is None:
        return []
    out = []
    for index, tool in enumerate(object_list(tools, "tools")):
        kind = tool.get("type")
        if kind not in (None, "custom"):  # a server or versioned tool: a provider runs it
            dropped.append(str(tool.get("name") or kind))
            continue
        where = f"tools[{index}]"
        function: dict[str, Any] = {"name": text(tool, "name", where)}
        if not function["name"]:
            raise RequestError(f"'{where}.name' is required", f"{where}.name")
        if tool.get("description") is not None:
            function["description"] = text(tool, "description", where)
        schema = tool.get("input_schema") or {}
        if not isinstance(schema, dict):
            raise RequestError(f"'{where}.input_schema' must be an object", f"{where}.input_schema")
        function["parameters"] = schema
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if choice is None:
        return
    if not isinstance(choice, dict):
        raise RequestError("'tool_choice' must be an object", "tool_choice")
    kind = typed(choice, "tool_choice")
    if kind == "none":
        chat["tool_choice"] = "none"
        return
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        name = text(choice, "name", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise RequestError(f"'tool_choice.type' {kind!r} is not supported", "tool_choice.type")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """A JSON schema the answer must follow (``output_format``, or
    ``output_config.format``) as chat's ``response_format``."""
    config = body.get("output_config")
    spec = body.get("output_format")
    if spec is None and isinstance(config, dict):
        spec = config.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        raise RequestError(
            "the output format must be {'type': 'json_schema', 'schema'}", "output_format"
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError("the output format's 'schema' must be an object", "output_format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


__all__ = ["REFUSED_FIELDS", "SAMPLING_FIELDS", "MessagesContext", "parse_messages_request"]
