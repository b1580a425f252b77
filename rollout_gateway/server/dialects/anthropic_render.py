"""The engine's chat completion as an Anthropic ``Message``, and errors in Anthropic's shape.

An answer's blocks, in the order the engine produces them: a ``thinking`` block for the
reasoning (unless the agent disabled thinking; its ``signature`` is empty: the gateway
signs nothing), a ``text`` block for the content, a ``tool_use`` block per tool call
(``input``: the arguments parsed; ``{}`` when they are not a JSON object). Finish reasons
map to ``stop_reason``: ``length`` -> ``max_tokens``, an answer with tool calls ->
``tool_use``, ``content_filter`` -> ``refusal``, a matched stop string (vLLM's
``stop_reason``) -> ``stop_sequence``, else ``end_turn``. Usage: ``input_tokens``
without cache reads, ``cache_read_input_tokens`` when the engine reports cached tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from rollout_gateway.server.dialects.anthropic_wire import (
    ContentBlock,
    ErrorBody,
    Message,
    StopReason,
    Usage,
)
from rollout_gateway.server.dialects.completion import (
    OBJECT,
    content_text,
    first_choice,
    id_base,
    plain_text_answer,
    reasoning_of,
    tool_call_parts,
    usage_counts,
)
from rollout_gateway.server.dialects.errors import GatewayError

#: Anthropic's error ``type`` for each status the gateway answers with (others: 4xx
#: ``invalid_request_error``, 5xx ``api_error``). The SDKs pick their typed error by status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


#: The usual answer (:func:`usual_answer`) as ``orjson`` writes :func:`render_message`'s
#: object: its fields in that order, no spaces; the ids' base, the model's and the text's
#: JSON and the counts filled in.
_USUAL_MESSAGE = (
    b'{"id":"msg_%b","type":"message","role":"assistant","model":%b,'
    b'"content":[{"type":"text","text":%b}],"stop_reason":"end_turn","stop_sequence":null,'
    b'"usage":{"input_tokens":%d,"output_tokens":%d}}'
)
#: What ``orjson`` writes of an integer: below ``2**64`` (else it refuses the answer).
_INT_END = 2**64


def message_id(completion_id: Any) -> str:
    """The answer's id, from the engine's completion id."""
    return "msg_" + id_base(completion_id)


def stop_of(choice: Mapping[str, Any], has_calls: bool) -> tuple[StopReason, str | None]:
    """``(stop_reason, stop_sequence)`` of an answer's choice."""
    finish = choice.get("finish_reason")
    if finish == "length":
        return "max_tokens", None
    if has_calls:  # ("tool_calls" without a parsed call: nothing for the agent to run)
        return "tool_use", None
    if finish == "content_filter":
        return "refusal", None
    stop = choice.get("stop_reason")
    if isinstance(stop, str):  # vLLM: the stop string that matched (an int: a stop token)
        return "stop_sequence", stop
    return "end_turn", None


def usage_of(usage: Any) -> Usage:
    """A chat ``usage`` in Anthropic's counts."""
    counts = usage_counts(usage)
    out: Usage = {
        "input_tokens": max(counts.prompt - (counts.cached or 0), 0),
        "output_tokens": counts.completion,
    }
    if counts.cached is not None:
        out["cache_read_input_tokens"] = counts.cached
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as ``tool_use.input`` (``{}`` unless a JSON object)."""
    try:
        value = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: Mapping[str, Any], show_thinking: bool) -> list[ContentBlock]:
    """The answer's blocks (see the module doc)."""
    blocks: list[ContentBlock] = []
    reasoning = reasoning_of(message)
    if reasoning and show_thinking:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    content = content_text(message)
    if content:
        blocks.append({"type": "text", "text": content})
    for call in message.get("tool_calls") or ():
        if isinstance(call, OBJECT):
            _, call_id, name, arguments = tool_call_parts(call)
            blocks.append(
                {"type": "tool_use", "id": call_id, "name": name, "input": tool_input(arguments)}
            )
    return blocks


def render_message(completion: Mapping[str, Any], show_thinking: bool) -> Message:
    """The whole answer."""
    choice = first_choice(completion)
    message = choice.get("message")
    message = message if isinstance(message, OBJECT) else {}
    stop_reason, stop_sequence = stop_of(choice, bool(message.get("tool_calls")))
    return {
        "id": message_id(completion.get("id")),
        "type": "message",
        "role": "assistant",
        "model": str(completion.get("model") or ""),
        "content": content_blocks(message, show_thinking),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_of(completion.get("usage")),
    }


def usual_answer(completion: Mapping[str, Any]) -> tuple[str, int, int] | None:
    """``(text, prompt tokens, completion tokens)`` of the usual answer: choice 0 a
    message of text only (some text, no tool calls, no reasoning field), ended by the
    model (``end_turn``: not cut, not filtered, no stop string), the engine's usual
    ``usage`` (two counts, no details); ``None`` for any other, which
    :func:`render_message` renders."""
    plain = plain_text_answer(completion)
    if plain is None:
        return None
    choice, text, (prompt, completed) = plain
    finish = choice.get("finish_reason")
    if (
        not text
        or finish == "length"
        or finish == "content_filter"
        or isinstance(choice.get("stop_reason"), str)
        or prompt >= _INT_END
        or completed >= _INT_END
    ):
        return None
    return text, prompt, completed


def render_message_json(completion: Mapping[str, Any], show_thinking: bool) -> bytes:
    """``orjson.dumps(render_message(completion, show_thinking))``: the usual answer
    (:func:`usual_answer`) written at once from a template, any other rendered whole.
    Raises ``TypeError`` (orjson's) for what orjson cannot write, as the dump does."""
    usual = usual_answer(completion)
    if usual is None:
        return orjson.dumps(render_message(completion, show_thinking))
    text, prompt, completed = usual
    return _USUAL_MESSAGE % (
        id_base(completion.get("id")).encode(),
        orjson.dumps(str(completion.get("model") or "")),
        orjson.dumps(text),
        prompt,
        completed,
    )


def thinking_state(message: Mapping[str, Any], show_thinking: bool) -> list[dict[str, Any]]:
    """The state blocks the agent will echo for ``message``'s answer (its thinking block)."""
    reasoning = reasoning_of(message)
    if reasoning and show_thinking:
        return [{"type": "thinking", "thinking": reasoning, "signature": ""}]
    return []


def error_body(error: GatewayError) -> ErrorBody:
    """``error`` in Anthropic's shape; the gateway's code under ``details.error_code``."""
    status = error.status
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    body: ErrorBody = {"type": "error", "error": {"type": kind, "message": error.message}}
    if error.code:
        body["error"]["details"] = {"error_code": error.code}
    return body


__all__ = [
    "ERROR_TYPES",
    "content_blocks",
    "error_body",
    "message_id",
    "render_message",
    "render_message_json",
    "stop_of",
    "thinking_state",
    "tool_input",
    "usage_of",
    "usual_answer",
]
