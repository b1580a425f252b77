"""An Anthropic Messages request as the chat request the engine gets.

The messages are what verifiers v1's own ``AnthropicDialect.parse_request`` makes of the
same request (so a v1 trace rebuilt from the gateway's record equals the one v1's own
interception records; ``tests/server/dialects/test_v1_parity.py`` checks it on real
Claude Code requests), written as chat messages:

- ``system`` (a string or text blocks) -> one system message; a single text block is
  its text, several are text parts (``cache_control`` and other block keys dropped);
- an assistant turn -> one assistant message: its text blocks joined, its ``thinking``
  blocks joined as ``reasoning_content``, each ``tool_use`` a tool call (its ``input``
  as JSON: compact, where v1 writes ``json.dumps``' spaced form; both compare
  arguments canonically), every other block (thinking, redacted
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

from dataclasses import dataclass
from typing import Any

import orjson

from rollout_gateway.server.dialects.base import ParsedRequest, field_names
from rollout_gateway.server.dialects.errors import RequestError
from rollout_gateway.server.dialects.memo import (
    ConversationMemo,
    HeadMemo,
    ParseMemo,
    ToolsMemo,
    extended_text,
    rest_of,
)
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
from rollout_gateway.server.http.jsonio import ConversationText

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
_REFUSED = frozenset(REFUSED_FIELDS)
#: The fields the conversation is read from (the conversation memo compares them).
_CONVERSATION = ("messages", "system")


@dataclass(frozen=True, slots=True)
class MessagesContext:
    """What the Anthropic renderers need from the request."""

    #: Whether thinking blocks are answered (not when the agent sent
    #: ``thinking: {"type": "disabled"}``; the reasoning is recorded either way).
    show_thinking: bool = True


_SHOW_THINKING = MessagesContext(show_thinking=True)
_HIDE_THINKING = MessagesContext(show_thinking=False)


def parse_messages_request(
    body: dict[str, Any],
    *,
    count_only: bool = False,
    memo: ParseMemo | None = None,
    text: ConversationText | None = None,
) -> ParsedRequest:
    """``body`` (``POST /v1/messages``, or its ``count_tokens`` with ``count_only``) as
    the chat request the engine gets, with the turn's facts. ``memo``: the rollout's
    previous request's (:mod:`.memo`; only what is new is translated);
    ``text``: ``messages`` as the intake wrote it."""
    for key in _REFUSED.intersection(body):  # (none, in the usual case)
        if body.get(key):
            raise RequestError(
                f"'{key}' asks the provider to run tools itself; this gateway serves a model "
                "only (the agent's own tools run in its sandbox)",
                key,
            )
    if text is not None and text.field != "messages":
        text = None  # not the list the parse reads
    conversation = _conversation(body, memo.conversation if memo is not None else None, text)
    messages = conversation.messages
    head, tools = _head(body, count_only, memo)
    chat: dict[str, Any] = {"messages": messages, "stream": head.stream}
    if tools.tools:
        chat["tools"] = tools.tools
    chat.update(head.chat)
    facts = dict(head.facts)
    note_facts(
        facts,
        dropped_tools=tools.dropped,
        dropped_content=[name for names in conversation.dropped.values() for name in names],
    )
    return ParsedRequest(
        dialect="anthropic",
        body=chat,
        messages=messages,
        messages_text=conversation.messages_text or orjson.dumps(messages),
        stream=head.stream,
        facts=facts,
        context=head.context,
        memo=ParseMemo(conversation, tools, head),
    )


def _head(
    body: dict[str, Any], count_only: bool, memo: ParseMemo | None
) -> tuple[HeadMemo, ToolsMemo]:
    """What the fields beside ``messages`` and ``system`` make, and the tools: the
    ``memo``'s when those fields are ``==`` (a ``count_tokens`` body's never: it reads
    ``stream`` and ``max_tokens`` otherwise)."""
    rest = rest_of(body, _CONVERSATION)
    previous = memo.head if memo is not None and not count_only else None
    if previous is not None and memo is not None and memo.tools is not None:
        if rest == previous.rest:
            return previous, memo.tools  # the same tools too: they are in ``rest``
    stream = bool(optional_bool(body, "stream")) and not count_only
    tools = _tools(body.get("tools"), memo.tools if memo is not None else None)
    chat: dict[str, Any] = {}
    _tool_choice(body.get("tool_choice"), chat)
    max_tokens = positive_int(body, "max_tokens", required=not count_only)
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    if body.get("stop_sequences") is not None:
        chat["stop"] = string_list(body["stop_sequences"], "stop_sequences")
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    thinking = body.get("thinking")
    show = not (isinstance(thinking, dict) and thinking.get("type") == "disabled")
    facts: dict[str, Any] = {"dialect": "anthropic"}
    sampling = {k: body[k] for k in SAMPLING_FIELDS.intersection(body)}
    if sampling:
        facts["agent_sampling"] = sampling
    note_facts(facts, ignored_fields=field_names(body, _READ_FIELDS))
    context = _SHOW_THINKING if show else _HIDE_THINKING
    return HeadMemo(rest, stream, chat, facts, context), tools


def _conversation(
    body: dict[str, Any], memo: ConversationMemo | None, text: ConversationText | None
) -> ConversationMemo:
    """The request's chat messages, those of the leading messages the ``memo``'s request
    had already taken from it."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array", "messages")
    system = body.get("system")
    reuse = memo.reusable(system, raw, text) if memo is not None else 0
    dropped: dict[int, list[str]] = {}
    if reuse:
        assert memo is not None
        out = memo.messages[: memo.ends[reuse - 1]]
        ends = memo.ends[:reuse]
        dropped = (
            {i: names for i, names in memo.dropped.items() if i < reuse} if memo.dropped else {}
        )
    else:
        out, ends = [], []
        if system:
            names: list[str] = []
            out.append({"role": "system", "content": _content(system, "system", names)})
            if names:
                dropped[-1] = names
    for index in range(reuse, len(raw)):
        names = []
        _message(raw[index], index, out, names)
        ends.append(len(out))
        if names:
            dropped[index] = names
    # The previous text reused when all of the memo's messages were (the usual turn).
    whole = memo if reuse and memo is not None and ends[reuse - 1] == len(memo.messages) else None
    conversation = ConversationMemo(system, raw, out, ends, dropped, text=text)
    conversation.messages_text = extended_text(out, whole)
    return conversation


def _message(message: Any, index: int, out: list[dict[str, Any]], dropped: list[str]) -> None:
    """One native message as the chat messages it becomes (appended to ``out``)."""
    role = message.get("role") if type(message) is dict else None
    text = _only_text(message.get("content")) if role is not None else None
    if text is not None and role in ("user", "system"):  # the usual turn: one text block
        out.append({"role": "user", "content": text})
    elif text is not None and role == "assistant":
        out.append({"role": "assistant", "content": text or None})
    elif role == "assistant":
        out.append(_assistant(message.get("content"), f"messages[{index}].content", dropped))
    elif role == "user" or role == "system":
        _user_turn(message.get("content"), f"messages[{index}].content", out, dropped)
    elif type(message) is not dict:
        raise RequestError(f"'messages[{index}]' must be an object", f"messages[{index}]")
    else:
        where = f"messages[{index}].role"
        raise RequestError(f"'{where}' must be 'user' or 'assistant'", where)


def _only_text(content: Any) -> str | None:
    """The text of ``content`` when it is one text block with a string ``text`` (what
    :func:`_user_turn` and :func:`_assistant` make of it at more cost), else ``None``."""
    if type(content) is list and len(content) == 1:
        block = content[0]
        if type(block) is dict and block.get("type") == "text":
            value = block.get("text", "")
            if type(value) is str:
                return value
    return None


def _content(content: Any, where: str, dropped: list[str]) -> str | list[dict[str, Any]]:
    """User-side content: a string, one text block's text, else text and image parts."""
    if type(content) is str:
        return content
    if content is None:
        return []
    if type(content) is not list:
        object_list(content, where)  # raises, naming the field
    if len(content) == 1 and type(content[0]) is dict and content[0].get("type") == "text":
        return _text(content[0], "text", where, 0)
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        kind = _kind(block, where, index)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, "text", where, index)})
        elif kind == "image":
            url = _image_url(block, f"{where}[{index}]")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            dropped.append(kind)
    return parts


def _kind(block: Any, where: str, index: int) -> str:
    """A content block's ``type`` (the path is only written for an error: a turn reads
    every block of the history)."""
    kind = block.get("type") if type(block) is dict else None
    if type(kind) is str:
        return kind
    if type(block) is not dict:
        raise RequestError(f"'{where}[{index}]' must be an object", f"{where}[{index}]")
    return typed(block, f"{where}[{index}]")  # raises


def _text(block: dict[str, Any], key: str, where: str, index: int) -> str:
    """``block[key]``, a string (``""`` when absent)."""
    value = block.get(key, "")
    return value if type(value) is str else text(block, key, f"{where}[{index}]")


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
    if type(content) is str:
        return {"role": "assistant", "content": content or None}
    if content is None:
        content = []
    elif type(content) is not list:
        object_list(content, where)  # raises, naming the field
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    state: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        kind = _kind(block, where, index)
        if kind == "text":
            texts.append(_text(block, "text", where, index))
        elif kind == "tool_use":
            calls.append(_tool_call(block, where, index))
        else:
            state.append(block)
            if kind == "thinking":
                thinking.append(_text(block, "thinking", where, index))
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


def _tool_call(block: dict[str, Any], where: str, index: int) -> dict[str, Any]:
    function: dict[str, Any] = {
        "name": _text(block, "name", where, index),
        # Compact JSON (v1 writes json.dumps' spaced form: both the gateway's history
        # check and v1's message identity compare arguments canonically, and engines
        # parse them before templating). orjson: a tenth of json.dumps' time, and a turn
        # translates every call of the history.
        "arguments": orjson.dumps(block.get("input") or {}).decode(),
    }
    namespace = block.get("toolset_name")
    if type(namespace) is str:
        function["namespace"] = namespace
    return {"id": _text(block, "id", where, index), "type": "function", "function": function}


def _user_turn(content: Any, where: str, out: list[dict[str, Any]], dropped: list[str]) -> None:
    if type(content) is str:
        out.append({"role": "user", "content": content})
        return
    if content is None:
        return
    if type(content) is not list:
        object_list(content, where)  # raises, naming the field
    rest = []
    for index, block in enumerate(content):
        if _kind(block, where, index) == "tool_result":
            call_id = _text(block, "tool_use_id", where, index)
            result = block.get("content")
            if type(result) is not str:
                result = _content(result, f"{where}[{index}].content", dropped)
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            rest.append(block)
    if rest:
        out.append({"role": "user", "content": _content(rest, where, dropped)})


def _tools(native: Any, memo: ToolsMemo | None) -> ToolsMemo:
    """The engine's tools (the ``memo``'s when the declarations are the same: agents send
    the same tools every turn)."""
    if memo is not None and native == memo.native:
        return memo
    tools: list[dict[str, Any]] = []
    dropped: list[str] = []
    for index, tool in enumerate(object_list(native, "tools") if native is not None else ()):
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
        tools.append({"type": "function", "function": function})
    return ToolsMemo(native, tools, dropped)


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
