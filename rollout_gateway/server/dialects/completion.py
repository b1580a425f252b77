"""Reading the engine's chat completion (and its chunks) for the dialect renderers.

The engine answers every turn as a chat completion: vLLM's shape, choice 0 being the
recorded sample (a registered ``n > 1`` keeps its other choices in the step; the agent
of a dialect without ``n`` sees choice 0). Reasoning comes as ``reasoning`` (vLLM >=
0.10) or ``reasoning_content`` (SGLang, older vLLM). The renderers read those facts
here, once; :func:`completion_chunks` cuts a whole completion into the chunks a stream of
it would have had, so one stream state machine serves streamed and whole answers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
#: What a JSON object may be here: ``isinstance(x, OBJECT)`` answers a ``dict`` (what the
#: engine's JSON always is) at once, without the ``Mapping`` ABC's check (a Python call).
OBJECT = (dict, Mapping)


def first_choice(completion: Mapping[str, Any]) -> Mapping[str, Any]:
    """Choice 0 of ``completion`` (``{}`` when it has none)."""
    choices = completion.get("choices")
    if type(choices) is list and len(choices) == 1 and type(choices[0]) is dict:
        choice = choices[0]  # the usual answer: one choice, read without a loop
        return choice if choice.get("index", 0) == 0 else {}
    for choice in choices or ():
        if isinstance(choice, OBJECT) and choice.get("index", 0) == 0:
            return choice
    return {}


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """The message's reasoning text, under either name engines use."""
    text = message.get("reasoning")
    if not isinstance(text, str) or not text:
        text = message.get("reasoning_content")
    return text if isinstance(text, str) and text else None


def content_text(message: Mapping[str, Any]) -> str | None:
    """The message's text: its ``content`` string, or the text of its content parts."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, OBJECT) and isinstance(part.get("text"), str)
        )
    return None


def delta_reasoning(delta: Mapping[str, Any]) -> str | None:
    """A chunk delta's reasoning text, under either name."""
    text = delta.get("reasoning")
    if not isinstance(text, str):
        text = delta.get("reasoning_content")
    return text if isinstance(text, str) and text else None


def id_base(completion_id: Any) -> str:
    """The part of the engine's completion id the dialects' ids are built from
    (``chatcmpl-abc`` -> ``abc``): the same for a streamed answer, its chunks and a
    replay of it, and safe in an id (Anthropic's ``^[a-zA-Z0-9_-]+$``)."""
    text = completion_id if isinstance(completion_id, str) and completion_id else "gateway"
    text = text.removeprefix("chatcmpl-")
    if text.isascii() and text.isalnum():  # the usual (vLLM's hex): nothing to remove
        return text[:96]
    return _ID_UNSAFE.sub("", text)[:96] or "gateway"


class UsageCounts(NamedTuple):
    """An answer's token counts, as every dialect reports them (a named tuple: made
    every turn, in one call)."""

    prompt: int
    completion: int
    cached: int | None
    reasoning: int | None


def usual_counts(usage: dict[str, Any]) -> tuple[int, int] | None:
    """The prompt and completion counts of the engine's usual ``usage`` (two counts, no
    details), read at once; ``None`` for any other (:func:`usage_counts` reads it)."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if (
        type(prompt) is int
        and type(completion) is int
        and prompt >= 0
        and completion >= 0
        and usage.get("prompt_tokens_details") is None
        and usage.get("completion_tokens_details") is None
    ):
        return prompt, completion
    return None


def plain_text_answer(
    completion: Mapping[str, Any],
) -> tuple[Mapping[str, Any], str, tuple[int, int]] | None:
    """``(choice 0, its text, the usage counts)`` when choice 0 is a message of text only
    (a string content, no tool calls, no reasoning field) and the engine's ``usage`` the
    usual one (:func:`usual_counts`); ``None`` for any other. Where each dialect's template
    for the usual answer starts (its own conditions come after)."""
    choice = first_choice(completion)
    message = choice.get("message")
    if type(message) is not dict:
        return None
    text = message.get("content")
    usage = completion.get("usage")
    if (
        type(text) is not str
        or message.get("tool_calls")
        or message.get("reasoning") is not None
        or message.get("reasoning_content") is not None
        or type(usage) is not dict
    ):
        return None
    counts = usual_counts(usage)
    return None if counts is None else (choice, text, counts)


def usage_counts(usage: Any) -> UsageCounts:
    """The counts of a chat ``usage`` object (zeros for what it does not say)."""
    if type(usage) is dict and (usual := usual_counts(usage)) is not None:
        return UsageCounts(usual[0], usual[1], None, None)
    if not isinstance(usage, OBJECT):
        return UsageCounts(0, 0, None, None)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, OBJECT) else None
    out_details = usage.get("completion_tokens_details")
    reasoning = out_details.get("reasoning_tokens") if isinstance(out_details, OBJECT) else None
    return UsageCounts(
        _count(usage.get("prompt_tokens")) or 0,
        _count(usage.get("completion_tokens")) or 0,
        _count(cached),
        _count(reasoning),
    )


def _count(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is int:  # the usual case (a bool is no count: its type is bool)
        return value if value >= 0 else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def tool_call_parts(call: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """``(kind, id, name, arguments)`` of a chat tool call (``kind``: ``function`` or
    ``custom``; a custom call's arguments are its ``input``)."""
    kind = "custom" if call.get("type") == "custom" else "function"
    native = call.get(kind)
    native = native if isinstance(native, OBJECT) else {}
    arguments = native.get("input" if kind == "custom" else "arguments")
    return (
        kind,
        str(call.get("id") or ""),
        str(native.get("name") or ""),
        arguments if isinstance(arguments, str) else "",
    )


def completion_chunks(completion: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The chunks a stream of ``completion`` would have had (choice 0): the role, the
    reasoning, the content, one per tool call, the finish, the usage."""
    head = {
        "id": completion.get("id"),
        "object": "chat.completion.chunk",
        "created": completion.get("created"),
        "model": completion.get("model"),
    }
    choice = first_choice(completion)
    message = choice.get("message")
    message = message if isinstance(message, OBJECT) else {}

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, **extra}]}

    yield chunk({"role": "assistant", "content": ""})
    reasoning = reasoning_of(message)
    if reasoning:
        yield chunk({"reasoning": reasoning})
    content = content_text(message)
    if content:
        yield chunk({"content": content})
    for index, call in enumerate(message.get("tool_calls") or ()):
        if isinstance(call, OBJECT):
            yield chunk({"tool_calls": [{**call, "index": index}]})
    yield chunk(
        {}, finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason")
    )
    if completion.get("usage") is not None:
        yield {**head, "choices": [], "usage": completion["usage"]}


__all__ = [
    "OBJECT",
    "UsageCounts",
    "completion_chunks",
    "content_text",
    "delta_reasoning",
    "first_choice",
    "id_base",
    "plain_text_answer",
    "reasoning_of",
    "tool_call_parts",
    "usage_counts",
    "usual_counts",
]
