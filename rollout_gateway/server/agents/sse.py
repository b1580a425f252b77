"""Server-sent events synthesised from a full (non-streamed) chat completion.

Engines that cannot stream token ids (SGLang refuses them on streamed requests; an
unknown engine) are called non-streaming. When the agent asked for ``stream: true`` it
gets the completion re-encoded as ``chat.completion.chunk`` events that the OpenAI SDK's streaming
client accumulates back into the same message (content and tool-call deltas). The
choice's ``logprobs``, ``token_ids`` and ``stop_reason`` and the top-level
``prompt_token_ids``, when the completion has them, ride on the chunks as vLLM streams
them (so an agent that asked for logprobs gets them in the stream too).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from rollout_gateway.server.http.jsonio import dumps

logger = logging.getLogger("rollout_gateway.server")


def _event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


def completion_to_sse(completion: Mapping[str, Any], *, include_usage: bool = False) -> list[bytes]:
    """Encode ``completion`` (a ``chat.completion`` dict) as SSE events, ``[DONE]`` last."""
    return list(iter_completion_sse(completion, include_usage=include_usage))


def iter_completion_sse(
    completion: Mapping[str, Any], *, include_usage: bool = False
) -> Iterator[bytes]:
    """Yield the SSE events of ``completion`` one by one (see :func:`completion_to_sse`)."""
    base = {
        "id": completion.get("id", "chatcmpl-gateway"),
        "object": "chat.completion.chunk",
        "created": completion.get("created", 0),
        "model": completion.get("model", ""),
    }

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        **extra: Any,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        choice.update(extra)
        return _event({**base, "choices": [choice]})

    prompt_ids = completion.get("prompt_token_ids")
    for position, choice in enumerate(completion.get("choices") or ()):
        index = int(choice.get("index", position))
        message = choice.get("message") or {}
        first = {"role": message.get("role", "assistant"), "content": ""}
        if prompt_ids is not None and position == 0:
            yield _event(
                {
                    **base,
                    "choices": [
                        {"index": index, "delta": first, "logprobs": None, "finish_reason": None}
                    ],
                    "prompt_token_ids": prompt_ids,
                }
            )
        else:
            yield chunk(index, first)
        reasoning = {k: message[k] for k in ("reasoning", "reasoning_content") if message.get(k)}
        if reasoning:
            yield chunk(index, reasoning)
        content = message.get("content")
        if content:
            yield chunk(index, {"content": content})
        for call_index, call in enumerate(message.get("tool_calls") or ()):
            yield chunk(index, {"tool_calls": [_tool_call_delta(call_index, call)]})
        tail = {k: choice[k] for k in _CHOICE_TAIL if choice.get(k) is not None}
        yield chunk(index, {}, choice.get("finish_reason") or "stop", **tail)
    if include_usage and completion.get("usage") is not None:
        yield _event({**base, "choices": [], "usage": completion["usage"]})
    yield DONE_EVENT


#: A choice's fields its last chunk carries when the answer has them.
_CHOICE_TAIL = ("logprobs", "token_ids", "stop_reason")


def _tool_call_delta(index: int, call: Mapping[str, Any]) -> dict[str, Any]:
    """A whole tool call as one chunk's ``tool_calls`` delta."""
    function = call.get("function") or {}
    return {
        "index": index,
        "id": call.get("id"),
        "type": call.get("type", "function"),
        "function": {"name": function.get("name", ""), "arguments": function.get("arguments", "")},
    }


def error_event(message: str, code: str = "stream_error") -> bytes:
    """An SSE event carrying an OpenAI-shaped error (the OpenAI SDK raises on it)."""
    return _event({"error": {"message": message, "type": "upstream_error", "code": code}})


def guard_sse(events: Iterator[bytes]) -> Iterator[bytes]:
    """``events``, ended by an error event and ``[DONE]`` if producing them fails midway.

    A malformed answer must end the agent's stream with an error it can read, not break
    its connection mid-stream.
    """
    try:
        yield from events
    except Exception:
        logger.exception("stream aborted: malformed completion")
        yield error_event("the model's answer could not be streamed")
        yield DONE_EVENT


__all__ = ["DONE_EVENT", "completion_to_sse", "error_event", "guard_sse", "iter_completion_sse"]
