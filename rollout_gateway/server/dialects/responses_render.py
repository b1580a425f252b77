"""The engine's chat completion as an OpenAI Responses ``Response``; errors in OpenAI's shape.

Output items, in the order the engine produces them: a ``reasoning`` item for the
reasoning (its text as ``reasoning_text`` content, no summary), a ``message`` with the
text (also an empty one when the answer has neither text nor tool calls), a
``function_call`` per tool call (with its ``namespace`` when the request declared the
tool in one) or a ``custom_tool_call``. ``status`` is ``completed``, or ``incomplete``
(``incomplete_details.reason``: ``max_output_tokens`` / ``content_filter``) when the
engine cut the answer. Item ids are derived from the engine's completion id, so a
streamed answer's events, its final object and a replay agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from rollout_gateway.protocol import error_code
from rollout_gateway.server.dialects.completion import (
    OBJECT,
    content_text,
    first_choice,
    id_base,
    plain_text_answer,
    reasoning_of,
    tool_call_parts,
    usage_counts,
    usual_counts,
)
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.dialects.responses_parse import ResponsesContext
from rollout_gateway.server.dialects.responses_wire import (
    CustomToolCallItem,
    ErrorBody,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    ReasoningItem,
    Response,
    Usage,
)

#: Why an answer is ``incomplete``, by the engine's finish reason.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}
#: The usual answer (:func:`usual_answer`) as ``orjson`` writes :func:`render_response`'s
#: object: its fields in that order, no spaces; the ids' base, the model's and the text's
#: JSON, the request's two fields' JSON and the counts filled in.
_USUAL_RESPONSE = (
    b'{"id":"resp_%b","object":"response","created_at":%d,"model":%b,"status":"completed",'
    b'"error":null,"incomplete_details":null,"output":[{"id":"msg_%b","type":"message",'
    b'"status":"completed","role":"assistant","content":[{"type":"output_text","text":%b,'
    b'"annotations":[],"logprobs":[]}]}],"parallel_tool_calls":%b,"tool_choice":%b,'
    b'"tools":[],"usage":{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},'
    b'"output_tokens":%d,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":%d}}'
)
#: What ``orjson`` writes of an integer: ``[-2**63, 2**64)`` (else it refuses the answer).
_INT_MIN, _INT_END = -(2**63), 2**64


def response_id(base: str) -> str:
    """The answer's id (``base``: :func:`~.completion.id_base` of the completion id)."""
    return "resp_" + base


def reasoning_item(base: str, text: str) -> ReasoningItem:
    """The reasoning item of an answer."""
    return {
        "id": "rs_" + base,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(base: str, text: str) -> MessageItem:
    """The message item of an answer."""
    return {
        "id": "msg_" + base,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(
    base: str, position: int, call: Mapping[str, Any], context: ResponsesContext
) -> FunctionCallItem | CustomToolCallItem:
    """The item of the answer's tool call at ``position``."""
    kind, call_id, name, arguments = tool_call_parts(call)
    if kind == "custom":
        return {
            "id": f"ctc_{base}_{position}",
            "type": "custom_tool_call",
            "call_id": call_id,
            "name": name,
            "input": arguments,
        }
    item: FunctionCallItem = {
        "id": f"fc_{base}_{position}",
        "type": "function_call",
        "status": "completed",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }
    namespace = context.namespaces.get(name)
    if namespace is not None:
        item["namespace"] = namespace
    return item


def output_items(
    base: str, message: Mapping[str, Any], context: ResponsesContext
) -> list[OutputItem]:
    """The answer's output items (see the module doc)."""
    items: list[OutputItem] = []
    if "reasoning" in message or "reasoning_content" in message:  # (else no call)
        reasoning = reasoning_of(message)
        if reasoning:
            items.append(reasoning_item(base, reasoning))
    raw_calls = message.get("tool_calls")
    calls = [c for c in raw_calls if isinstance(c, OBJECT)] if raw_calls else []
    content = message.get("content")
    if type(content) is not str:  # parts (or none): their text
        content = content_text(message)
    if content or not calls:
        items.append(message_item(base, content or ""))
    if calls:
        items.extend(call_item(base, i, call, context) for i, call in enumerate(calls))
    return items


def usage_of(usage: Any) -> Usage | None:
    """A chat ``usage`` in the Responses counts."""
    if type(usage) is dict:  # the engine's usual counts, without a UsageCounts
        usual = usual_counts(usage)
        if usual is not None:
            prompt, completion = usual
            return {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
    elif not isinstance(usage, OBJECT):
        return None
    counts = usage_counts(usage)
    return {
        "input_tokens": counts.prompt,
        "input_tokens_details": {"cached_tokens": counts.cached or 0},
        "output_tokens": counts.completion,
        "output_tokens_details": {"reasoning_tokens": counts.reasoning or 0},
        "total_tokens": counts.prompt + counts.completion,
    }


def response_head(base: str, created: Any, model: Any, context: ResponsesContext) -> Response:
    """The answer before its output: what ``response.created`` carries."""
    return {
        "id": response_id(base),
        "object": "response",
        "created_at": created if isinstance(created, int) else 0,
        "model": str(model or ""),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "output": [],
        "parallel_tool_calls": context.parallel_tool_calls,
        "tool_choice": context.tool_choice,
        "tools": [],
        "usage": None,
    }


def render_response(
    completion: Mapping[str, Any], context: ResponsesContext, base: str | None = None
) -> Response:
    """The whole answer (:func:`response_head`'s fields, in its order, written at once).
    ``base``: :func:`~.completion.id_base` of the completion's id, when known."""
    if base is None:
        base = id_base(completion.get("id"))
    choice = first_choice(completion)
    message = choice.get("message")
    message = message if isinstance(message, OBJECT) else {}
    incomplete = INCOMPLETE_REASONS.get(str(choice.get("finish_reason")))
    created = completion.get("created")
    return {
        "id": response_id(base),
        "object": "response",
        "created_at": created if isinstance(created, int) else 0,
        "model": str(completion.get("model") or ""),
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "output": output_items(base, message, context),
        "parallel_tool_calls": context.parallel_tool_calls,
        "tool_choice": context.tool_choice,
        "tools": [],
        "usage": usage_of(completion.get("usage")),
    }


def usual_answer(completion: Mapping[str, Any]) -> tuple[str, int, int, int] | None:
    """``(text, created, prompt tokens, completion tokens)`` of the usual answer: choice
    0 a message of text only (no tool calls, no reasoning field), finished (not cut), an
    integer ``created``, the engine's usual ``usage`` (two counts, no details); ``None``
    for any other, which :func:`render_response` renders."""
    plain = plain_text_answer(completion)
    if plain is None:
        return None
    choice, text, (prompt, completed) = plain
    created = completion.get("created")
    if (
        str(choice.get("finish_reason")) in INCOMPLETE_REASONS
        or type(created) is not int
        or not _INT_MIN <= created < _INT_END
        or prompt + completed >= _INT_END
    ):
        return None
    return text, created, prompt, completed


def render_response_json(completion: Mapping[str, Any], context: ResponsesContext) -> bytes:
    """``orjson.dumps(render_response(completion, context))``: the usual answer
    (:func:`usual_answer`) written at once from a template, any other rendered whole.
    Raises ``TypeError`` (orjson's) for what orjson cannot write, as the dump does."""
    usual = usual_answer(completion)
    if usual is None:
        return orjson.dumps(render_response(completion, context))
    return usual_response_json(completion, context, usual, id_base(completion.get("id")))


def usual_response_json(
    completion: Mapping[str, Any],
    context: ResponsesContext,
    usual: tuple[str, int, int, int],
    base: str,
) -> bytes:
    """The usual answer's JSON from its template (``usual``: :func:`usual_answer` of
    ``completion``; ``base``: :func:`~.completion.id_base` of its id)."""
    text, created, prompt, completed = usual
    ids = base.encode()
    parallel, tool_choice = context.parallel_tool_calls, context.tool_choice
    echo = None
    if type(tool_choice) is str and type(parallel) is bool:
        echo = _ECHOES.get((parallel, tool_choice))
    if echo is None:
        echo = (orjson.dumps(parallel), orjson.dumps(tool_choice))
    return _USUAL_RESPONSE % (
        ids, created, orjson.dumps(str(completion.get("model") or "")), ids,
        orjson.dumps(text), echo[0], echo[1], prompt, completed, prompt + completed,
    )  # fmt: skip


#: The JSON of the usual requests' ``parallel_tool_calls`` and ``tool_choice``, written
#: once (by ``(parallel_tool_calls, tool_choice)``; only these: the agent picks the string).
_ECHOES = {
    (parallel, choice): (orjson.dumps(parallel), orjson.dumps(choice))
    for parallel in (True, False)
    for choice in ("auto", "none", "required")
}


def error_body(error: GatewayError) -> ErrorBody:
    """``error`` in OpenAI's shape (the SDK picks its typed error by status)."""
    default = "server_error" if error.status >= 500 else "invalid_request_error"
    return {
        "error": {
            "message": error.message,
            "type": error.error_type or default,
            "param": error.param,
            "code": error.code or error_code(error.status),
        }
    }


__all__ = [
    "INCOMPLETE_REASONS",
    "call_item",
    "error_body",
    "message_item",
    "output_items",
    "reasoning_item",
    "render_response",
    "render_response_json",
    "response_head",
    "response_id",
    "usage_of",
    "usual_answer",
    "usual_response_json",
]
