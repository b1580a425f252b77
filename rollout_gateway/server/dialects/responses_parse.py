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
from rollout_gateway.server.dialects.memo import (
    ConversationMemo,
    HeadMemo,
    ParseMemo,
    ToolsMemo,
    extended_text,
    extends,
    rest_of,
)
from rollout_gateway.server.dialects.reading import (
    STATE_FIELD,
    note_facts,
    object_list,
    optional_bool,
    positive_int,
    text,
)
from rollout_gateway.server.http.jsonio import ConversationText

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
_SERVER_STATE = frozenset((*REFUSED_FIELDS, "background"))
_TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")
_CALLS = ("function_call", "custom_tool_call")
#: Item fields v1's message hash keeps as opaque state.
_STATE_KEYS = ("encrypted_content", "signature", "data", "phase")
_STATE = frozenset(_STATE_KEYS)
_TEXT_PARTS = ("input_text", "output_text")
#: The fields the conversation is read from (the conversation memo compares them).
_CONVERSATION = ("input", "instructions")
_DICT = {dict}


@dataclass(frozen=True, slots=True)
class ResponsesContext:
    """What the Responses renderers need from the request."""

    #: The namespace of each namespaced function tool, by its name.
    namespaces: dict[str, str] = field(default_factory=dict)
    #: Echoed on the answer as the request sent them.
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True


def parse_responses_request(
    body: dict[str, Any],
    memo: ParseMemo | None = None,
    text: ConversationText | None = None,
) -> ParsedRequest:
    """``body`` (``POST /responses``) as the chat request the engine gets, with the
    turn's facts. ``memo``: the rollout's previous request's (:mod:`.memo`; only what is
    new is translated); ``text``: ``input`` as the intake wrote it."""
    if not _SERVER_STATE.isdisjoint(body):  # (the usual body: no such field, one C pass)
        _refuse_server_state(body)
    raw = body.get("input")
    if text is not None and (type(raw) is not list or text.field != "input"):
        text = None  # not the list it was written from
    previous = memo.conversation if memo is not None else None
    # The previous request's items, repeated in the text: objects already (checked then).
    extended = (
        previous is not None
        and text is not None
        and previous.text is not None
        and extends(text, previous.text)
    )  # (ConversationMemo.extended_by, inline: one Python call less a turn)
    items = _items(raw, len(previous.native) if extended and previous is not None else 0)
    conversation = _conversation(body, items, previous, text, extended)
    messages = conversation.messages
    head, tools = _head(body, conversation.declared, memo)
    chat: dict[str, Any] = {"messages": messages, "stream": head.stream}
    if tools.tools:
        chat["tools"] = tools.tools
    chat.update(head.chat)
    facts = dict(head.facts)
    if tools.dropped or conversation.dropped:  # (else nothing to note)
        note_facts(
            facts,
            dropped_tools=tools.dropped,
            dropped_content=[name for names in conversation.dropped.values() for name in names],
        )
    context = head.context
    if context.namespaces is not tools.namespaces:  # tools declared anew
        context = head.context = ResponsesContext(
            tools.namespaces, context.tool_choice, context.parallel_tool_calls
        )
    # Positional (dialect, body, messages, messages_text, stream, facts, context, memo):
    # keywords cost a dict of them per call.
    return ParsedRequest(
        "responses", chat, messages, conversation.messages_text or orjson.dumps(messages),
        head.stream, facts, context, ParseMemo(conversation, tools, head),
    )  # fmt: skip


def _head(
    body: dict[str, Any], declared: list[tuple[int, Any]], memo: ParseMemo | None
) -> tuple[HeadMemo, ToolsMemo]:
    """What the fields beside ``input`` and ``instructions`` make, and the tools: the
    ``memo``'s when those fields are ``==`` (checked in the order a fresh parse checks
    them: ``stream``, the tools, then the rest)."""
    rest = rest_of(body, _CONVERSATION)
    previous = memo.head if memo is not None else None
    tools_memo = memo.tools if memo is not None else None
    if previous is not None and rest == previous.rest:
        if not declared and tools_memo is not None and not tools_memo.native[0]:
            return previous, tools_memo  # the same body tools, none from the items
        return previous, _tools(body, declared, tools_memo)
    stream = bool(optional_bool(body, "stream"))
    tools = _tools(body, declared, tools_memo)
    chat: dict[str, Any] = {}
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
    sampling = {k: body[k] for k in SAMPLING_FIELDS.intersection(body)}
    if sampling:
        facts["agent_sampling"] = sampling
    note_facts(facts, ignored_fields=field_names(body, _READ_FIELDS))
    choice = body.get("tool_choice")
    context = ResponsesContext(
        namespaces=tools.namespaces,
        tool_choice=choice if isinstance(choice, str | dict) else "auto",
        parallel_tool_calls=parallel is not False,
    )
    return HeadMemo(rest, stream, chat, facts, context), tools


def _refuse_server_state(body: dict[str, Any]) -> None:
    if _SERVER_STATE.isdisjoint(body):  # the usual case, in C
        return
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


def _items(raw: Any, checked: int = 0) -> list[dict[str, Any]]:
    """``input`` as a list of items, checked to be objects (but its first ``checked``,
    known to be)."""
    if raw is None:
        raise RequestError("'input' is required", "input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if type(raw) is list and len(raw) > checked:
        if set(map(type, raw[checked:] if checked else raw)) == _DICT:  # the usual case, in C
            return raw
    items = object_list(raw, "input")  # raises, naming the item
    if not items:
        raise RequestError("'input' must not be empty", "input")
    return items


def _conversation(
    body: dict[str, Any],
    items: list[dict[str, Any]],
    memo: ConversationMemo | None,
    text: ConversationText | None,
    extended: bool | None = None,
) -> ConversationMemo:
    """The request's chat messages, those of the leading items the ``memo``'s request had
    already taken from it (whole runs of assistant items only)."""
    instructions = body.get("instructions")
    if instructions and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string", "instructions")
    reuse = memo.reusable(instructions, items, text, extended) if memo is not None else 0
    if reuse:
        assert memo is not None
        end = memo.ends[reuse - 1]
        assert end is not None
        out = memo.messages[:end]
        ends = memo.ends[:reuse]
        dropped = (
            {i: names for i, names in memo.dropped.items() if i < reuse} if memo.dropped else {}
        )
        declared = [(i, tools) for i, tools in memo.declared if i < reuse] if memo.declared else []
    else:
        out = [{"role": "system", "content": instructions}] if instructions else []
        ends, dropped, declared = [], {}, []
    if not _plain_messages(items, reuse, out, ends):  # (the usual new items, in one loop)
        _translate(items, reuse, out, ends, dropped, declared)
    # The previous text reused when all of the memo's messages were (the usual turn).
    whole = memo if reuse and memo is not None and end == len(memo.messages) else None
    conversation = ConversationMemo(instructions, items, out, ends, dropped, declared, text)
    conversation.messages_text = extended_text(out, whole)
    return conversation


def _translate(
    items: list[dict[str, Any]],
    start: int,
    out: list[dict[str, Any]],
    ends: list[int | None],
    dropped: dict[int, list[str]],
    declared: list[tuple[int, Any]],
) -> None:
    """Translate ``items[start:]`` onto ``out`` (see the module doc), noting each item's
    end in ``ends``, what it dropped in ``dropped`` and the tools it declares in
    ``declared``."""
    run: list[dict[str, Any]] = []  # the current run of assistant-side items
    for index in range(start, len(items)):
        item = items[index]
        names: list[str] = []
        if item.get("type") in ("additional_tools", "tool_search_output"):
            declared.append((index, item.get("tools") or []))
        if _item(item, index, out, run, names):
            run = []
        ends.append(None if run else len(out))
        if names:
            dropped[index] = names
    if run:
        names = []
        out.append(_fold(run, names))
        if names:
            dropped[len(items)] = names


def _plain_messages(
    items: list[dict[str, Any]],
    start: int,
    out: list[dict[str, Any]],
    ends: list[int | None],
) -> bool:
    """Translate ``items[start:]`` when each is a ``message`` of one text part, no two
    assistant ones in a row, none with state (what an agent adds each turn: the answer
    echoed, a user message), in one loop: the messages :func:`_item` and :func:`_fold`
    make of them (:func:`_translate`'s, nothing dropped or declared). Else leave ``out``
    and ``ends`` as they were and return ``False``."""
    size, count = len(out), len(ends)
    answer: Any = _NO_ANSWER  # an assistant item's text, its message not yet written
    for item in items[start:]:
        content = item.get("content")
        if item.get("type") != "message" or type(content) is not list or len(content) != 1:
            break
        part = content[0]
        value = part.get("text") if type(part) is dict else None
        if type(value) is not str or part.get("type") not in _TEXT_PARTS:
            break
        role = item.get("role")
        if role == "assistant":
            if answer is not _NO_ANSWER or not _STATE.isdisjoint(item):
                break
            answer = value or None
            ends.append(None)
            continue
        if role == "user":
            message = {"role": "user", "content": [{"type": "text", "text": value}]}
        elif role == "developer" or role == "system":
            message = {"role": "system", "content": [{"type": "text", "text": value}]}
        else:
            break
        if answer is not _NO_ANSWER:
            out.append({"role": "assistant", "content": answer})
            answer = _NO_ANSWER
        out.append(message)
        ends.append(len(out))
    else:
        if answer is not _NO_ANSWER:
            out.append({"role": "assistant", "content": answer})
        return True
    del out[size:], ends[count:]
    return False


#: No assistant text waiting (:func:`_plain_messages`).
_NO_ANSWER = object()


def _item(
    item: dict[str, Any],
    index: int,
    out: list[dict[str, Any]],
    run: list[dict[str, Any]],
    dropped: list[str],
) -> bool:
    """Translate one input item: an assistant-side one joins ``run``; any other first
    closes the run into its message (returns whether it did), then becomes its own."""
    role = item.get("role")
    kind = item.get("type") or ""
    if type(kind) is not str:
        raise RequestError(f"'input[{index}].type' must be a string", f"input[{index}].type")
    if kind == "item_reference":
        raise RequestError(
            f"'input[{index}]' refers to a stored item: this gateway stores none; send the "
            "item itself",
            f"input[{index}]",
            code="unsupported_parameter",
        )
    if role == "assistant" or (role is None and not kind.endswith(("_output", "_response"))):
        run.append(item)
        return False
    closed = bool(run)
    if closed:
        out.append(_fold(run, dropped))
    if kind in _TOOL_OUTPUTS:
        output = item.get("output")
        if type(output) is str:
            content: Any = output
        elif isinstance(output, list):
            content = _content(output, f"input[{index}].output", dropped)
        else:
            content = json.dumps(output)  # as v1 writes it (it is the message's text)
        call_id = item.get("call_id")
        if type(call_id) is not str:
            call_id = text(item, "call_id", f"input[{index}]")
        out.append({"role": "tool", "tool_call_id": call_id, "content": content})
    else:
        content = item.get("content")
        if type(content) is not str:
            only = _one_text(content)  # the usual message: one text part
            if only is not None:
                content = [{"type": "text", "text": only}]
            else:
                content = _content(content, f"input[{index}].content", dropped)
        system = role == "system" or role == "developer"
        out.append({"role": "system" if system else "user", "content": content})
    return closed


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


def _one_text(content: Any) -> str | None:
    """The text of ``content`` when it is one text part with a string ``text`` (what the
    part loops make of it at more cost), else ``None``."""
    if type(content) is list and len(content) == 1:
        part = content[0]
        if type(part) is dict and part.get("type") in _TEXT_PARTS:
            value = part.get("text")
            if type(value) is str:
                return value
    return None


def _fold(run: list[dict[str, Any]], dropped: list[str]) -> dict[str, Any]:
    """A run of assistant-side items as one assistant message."""
    if len(run) == 1 and run[0].get("type") == "message" and _STATE.isdisjoint(run[0]):
        # The usual answer echoed: one message item of one text part, no state to keep.
        only = _one_text(run[0].get("content"))
        if only is not None:
            return {"role": "assistant", "content": only or None}
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
    if not _STATE.isdisjoint(item) and any(item.get(key) is not None for key in _STATE_KEYS):
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
    body: dict[str, Any], declared: list[tuple[int, Any]], memo: ToolsMemo | None
) -> ToolsMemo:
    """The engine's tools: those the items declare, then the request's (a later
    declaration of the same tool wins); the ``memo``'s when the declarations are the
    same (agents send the same tools every turn)."""
    native = ([tools for _, tools in declared], body.get("tools"))
    if memo is not None and native == memo.native:
        return memo
    declarations: list[Any] = [tool for tools in native[0] for tool in tools]
    if native[1] is not None:
        declarations.extend(object_list(native[1], "tools"))
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
    result = ToolsMemo(native, [], [])
    for (namespace, name, kind), tool in found.items():
        if kind == "function":
            function = _function(tool, name, namespace)
            result.tools.append({"type": "function", "function": function})
            if namespace is not None:
                result.namespaces[name] = namespace
        elif kind == "custom":
            custom = {k: tool[k] for k in ("description", "format") if tool.get(k) is not None}
            result.tools.append({"type": "custom", "custom": {"name": name, **custom}})
        else:  # hosted: a provider runs it
            result.dropped.append(name)
    return result


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
