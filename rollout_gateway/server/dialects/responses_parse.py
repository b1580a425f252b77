"""An OpenAI Responses request as the chat request the engine gets.

The messages are what verifiers v1's own ``ResponsesDialect.parse_request`` makes of the
same request (checked on real Codex requests by ``test_v1_parity.py``), as chat messages:

- ``instructions`` -> a system message; ``input`` as a string -> one user message;
- ``input`` items in order: each run of assistant-side items (reasoning, assistant
  messages, ``function_call`` / ``custom_tool_call``) -> one assistant message (texts
  joined, reasoning summaries and texts joined by newlines as ``reasoning_content``,
  the calls its tool calls); ``function_call_output`` / ``custom_tool_call_output`` ->
  a tool message; ``system`` and ``developer`` messages -> system messages (Codex opens
  with two developer messages); other messages -> user messages (``input_image`` parts
  as ``image_url``);
- items carrying state the chat shape has no field for (``encrypted_content``,
  ``phase``, refusal parts, tool calls of kinds the engine has no tool for) are kept
  under the message's ``reasoning_details``: exactly those v1's message hash reads.

Tools: ``function`` tools (also inside a ``namespace`` group, and those an
``additional_tools`` item declares) become chat function tools, ``custom`` tools chat
custom tools; hosted tools (``web_search``, ``file_search``, ``mcp``...) are not given
to the engine and are named in ``dropped_tools``.

Server-side state is refused with a 400 naming the field (``previous_response_id``,
``conversation``, ``prompt``, ``background``, ``item_reference`` items): the gateway
keeps no responses to continue from, and never silently starts afresh.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
    text,
)

#: The agent's sampling fields, recorded as sent (v1's ``ResponsesDialect.sampling_fields``).
SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "max_output_tokens",
        "max_tool_calls",
        "reasoning",
        "service_tier",
        "text",
        "tool_choice",
        "parallel_tool_calls",
        "top_logprobs",
        "truncation",
    }
)
_READ_FIELDS = SAMPLING_FIELDS | {"model", "input", "instructions", "tools", "stream"}
#: Fields that ask for state kept at the provider (refused when set).
REFUSED_FIELDS = ("previous_response_id", "conversation", "prompt")
_TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")
_CALLS = ("function_call", "custom_tool_call")
#: Item fields v1's message hash keeps as opaque state.
_STATE_KEYS = ("encrypted_content", "signature", "data", "phase")
_TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True, slots=True)
class ResponsesContext:
    """What the Responses renderers need from the request."""

    #: The namespace of each namespaced function tool, by its name.
    namespaces: dict[str, str] = field(default_factory=dict)
    #: Echoed on the answer as the request sent them.
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True


def parse_responses_request(body: dict[str, Any]) -> ParsedRequest:
    """``body`` (``POST /responses``) as the chat request the engine gets, with the
    turn's facts."""
    _refuse_server_state(body)
    dropped: list[str] = []
    items = _items(body.get("input"))
    messages = _conversation(body, items, dropped)
    chat: dict[str, Any] = {"messages": messages}
    stream = bool(optional_bool(body, "stream"))
    chat["stream"] = stream
    dropped_tools: list[str] = []
    tools, namespaces = _tools(body, items, dropped_tools)
    if tools:
        chat["tools"] = tools
    facts: dict[str, Any] = {"dialect": "responses"}
    _tool_choice(body.get("tool_choice"), chat, facts)
    parallel = optional_bool(body, "parallel_tool_calls")
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    max_tokens = positive_int(body, "max_output_tokens")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    sampling = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    if sampling:
        facts["agent_sampling"] = sampling
    note_facts(
        facts,
        ignored_fields=field_names(body, _READ_FIELDS),
        dropped_tools=dropped_tools,
        dropped_content=dropped,
    )
    choice = body.get("tool_choice")
    context = ResponsesContext(
        namespaces=namespaces,
        tool_choice=choice if isinstance(choice, str | dict) else "auto",
        parallel_tool_calls=parallel is not False,
    )
    return ParsedRequest(
        dialect="responses",
        body=chat,
        messages=messages,
        messages_text=orjson.dumps(messages),
        stream=stream,
        facts=facts,
        context=context,
    )


def _refuse_server_state(body: dict[str, Any]) -> None:
    for key in REFUSED_FIELDS:
        if body.get(key) is not None:
            raise RequestError(
                f"'{key}' is not supported: this gateway keeps no responses or "
                "conversations to continue from; send the whole conversation in 'input' "
                "(as Codex does with store: false)",
                key,
                code="unsupported_parameter",
            )
    if body.get("background") is True:
        raise RequestError(
            "'background' is not supported: answers come in the request's own response",
            "background",
            code="unsupported_parameter",
        )


def _items(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        raise RequestError("'input' is required", "input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    items = object_list(raw, "input")
    if not items:
        raise RequestError("'input' must not be empty", "input")
    return items


def _conversation(
    body: dict[str, Any], items: list[dict[str, Any]], dropped: list[str]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    run: list[dict[str, Any]] = []  # the current run of assistant-side items
    for index, item in enumerate(items):
        where = f"input[{index}]"
        role = item.get("role")
        kind = item.get("type") or ""
        if not isinstance(kind, str):
            raise RequestError(f"'{where}.type' must be a string", f"{where}.type")
        if kind == "item_reference":
            raise RequestError(
                f"'{where}' refers to a stored item: this gateway stores none; send the "
                "item itself",
                where,
                code="unsupported_parameter",
            )
        assistant = role == "assistant" or (
            role is None and not kind.endswith(("_output", "_response"))
        )
        if run and not assistant:
            out.append(_fold(run, dropped))
            run = []
        if assistant:
            run.append(item)
        elif kind in _TOOL_OUTPUTS:
            output = item.get("output")
            if isinstance(output, str | list):
                content: Any = _content(output, f"{where}.output", dropped)
            else:
                content = json.dumps(output)
            out.append(
                {"role": "tool", "tool_call_id": text(item, "call_id", where), "content": content}
            )
        elif role in ("system", "developer"):
            content = _content(item.get("content"), f"{where}.content", dropped)
            out.append({"role": "system", "content": content})
        else:
            content = _content(item.get("content"), f"{where}.content", dropped)
            out.append({"role": "user", "content": content})
    if run:
        out.append(_fold(run, dropped))
    return out


def _content(content: Any, where: str, dropped: list[str]) -> str | list[dict[str, Any]]:
    """A message's content: a string, or its text and image parts (v1 keeps a list a
    list, even of one part)."""
    if isinstance(content, str):
        return content
    if content is None:
        return []
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(object_list(content, where)):
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": text(part, "text", f"{where}[{index}]")})
        elif kind == "input_image":
            url = text(part, "image_url", f"{where}[{index}]")
            if not url:
                raise RequestError(
                    f"'{where}[{index}].image_url' is required (file ids need the "
                    "provider's file store)",
                    f"{where}[{index}].image_url",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            dropped.append(str(kind))
    return parts


def _fold(run: list[dict[str, Any]], dropped: list[str]) -> dict[str, Any]:
    """A run of assistant-side items as one assistant message."""
    content = ""
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in run:
        kind = item.get("type")
        if kind == "reasoning":
            for key in ("summary", "content"):
                reasoning.extend(
                    part.get("text") or "" for part in item.get(key) or () if isinstance(part, dict)
                )
        elif kind in _CALLS:
            calls.append(_call(item))
        else:
            raw = item.get("content")
            if isinstance(raw, str):
                content += raw
            else:
                content += "".join(
                    str(part.get("text") or "")
                    for part in raw or ()
                    if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
                )
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    joined = "\n".join(r for r in reasoning if r)
    if joined:
        message["reasoning_content"] = joined
    if calls:
        message["tool_calls"] = calls
    call_ids = {call["id"] for call in calls}
    state = [item for item in run if _has_state(item, call_ids)]
    if state:
        message[STATE_FIELD] = state
    return message


def _call(item: dict[str, Any]) -> dict[str, Any]:
    custom = item.get("type") == "custom_tool_call"
    kind = "custom" if custom else "function"
    arguments = item.get("arguments", item.get("input", ""))
    native: dict[str, Any] = {
        "name": str(item.get("name") or ""),
        ("input" if custom else "arguments"): arguments if isinstance(arguments, str) else "",
    }
    namespace = item.get("namespace")
    if isinstance(namespace, str):
        native["namespace"] = namespace
    return {"id": str(item.get("call_id") or ""), "type": kind, kind: native}


def _has_state(item: dict[str, Any], call_ids: set[str]) -> bool:
    """Whether ``item`` holds what the chat message does not (v1's message hash rule)."""
    if any(item.get(key) is not None for key in _STATE_KEYS):
        return True
    kind = item.get("type") or ("message" if item.get("role") == "assistant" else "")
    content = item.get("content")
    if kind == "message" and isinstance(content, list):
        if any(isinstance(p, dict) and p.get("type") not in _TEXT_PARTS for p in content):
            return True
    if kind in ("message", "reasoning"):
        return False
    return not (kind in _CALLS and item.get("call_id") in call_ids)


def _tools(
    body: dict[str, Any], items: list[dict[str, Any]], dropped: list[str]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The engine's tools (the request's, after those its items declare; a later
    declaration of the same tool wins) and the namespace of each namespaced one."""
    declarations: list[Any] = []
    for item in items:
        if item.get("type") in ("additional_tools", "tool_search_output"):
            declarations.extend(item.get("tools") or ())
    if body.get("tools") is not None:
        declarations.extend(object_list(body["tools"], "tools"))
    found: dict[tuple[str | None, str, str], dict[str, Any]] = {}
    for group in declarations:
        if not isinstance(group, dict):
            raise RequestError("each tool must be an object", "tools")
        namespace = group.get("name") if group.get("type") == "namespace" else None
        members = object_list(group.get("tools") or [], "tools") if namespace else [group]
        for tool in members:
            kind = str(tool.get("type") or "function")
            name = str(tool.get("name") or tool.get("server_label") or kind)
            found[(namespace, name, kind)] = tool
    tools: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    for (namespace, name, kind), tool in found.items():
        if kind == "function":
            tools.append({"type": "function", "function": _function(tool, name, namespace)})
            if namespace is not None:
                namespaces[name] = namespace
        elif kind == "custom":
            custom = {k: tool[k] for k in ("description", "format") if tool.get(k) is not None}
            tools.append({"type": "custom", "custom": {"name": name, **custom}})
        else:  # hosted: a provider runs it
            dropped.append(name)
    return tools, namespaces


def _function(tool: dict[str, Any], name: str, namespace: str | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if tool.get("description"):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters") or {}
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    if namespace is not None:
        function["namespace"] = namespace
    return function


def _tool_choice(choice: Any, chat: dict[str, Any], facts: dict[str, Any]) -> None:
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    name = choice.get("name") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(name, str):
        chat["tool_choice"] = {"type": kind, kind: {"name": name}}
        return
    if not isinstance(choice, dict):
        raise RequestError("'tool_choice' must be a string or an object", "tool_choice")
    facts["ignored_tool_choice"] = str(kind)[:64]  # hosted tools, allowed_tools: the engine picks


def _response_format(spec: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = spec.get("format") if isinstance(spec, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(
        f"'text.format.type' {fmt.get('type')!r} is not supported", "text.format.type"
    )


__all__ = ["REFUSED_FIELDS", "SAMPLING_FIELDS", "ResponsesContext", "parse_responses_request"]
