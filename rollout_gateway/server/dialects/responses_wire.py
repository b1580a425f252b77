"""OpenAI Responses wire shapes the gateway writes (answers, output items, errors).

They live beside the one adapter that writes them: the agents that read them bring their
own types (the ``openai`` SDK's ``responses`` API, Codex), which the tests check these
against. Requests are read as the agent's JSON (:mod:`.responses_parse`).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict


class OutputText(TypedDict):
    """A message's text part."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class MessageItem(TypedDict):
    """The answer's text."""

    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed"]
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(TypedDict):
    """The engine's reasoning, as raw reasoning text (no summary is made)."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(TypedDict):
    """The engine's reasoning (``summary`` empty, ``content`` the reasoning text)."""

    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningText]


class FunctionCallItem(TypedDict):
    """A function tool call (``namespace`` when the tool was declared in one)."""

    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed"]
    call_id: str
    name: str
    arguments: str
    namespace: NotRequired[str]


class CustomToolCallItem(TypedDict):
    """A custom (free-form input) tool call."""

    id: str
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem | CustomToolCallItem


class Usage(TypedDict):
    """Token counts (``input_tokens`` includes the cached ones)."""

    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class Response(TypedDict):
    """A whole answer (``POST /responses`` without ``stream``; the payload of the
    stream's ``response.*`` lifecycle events). ``tools`` is answered empty: the request's
    declarations are not echoed back."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, str] | None
    incomplete_details: dict[str, str] | None
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[Any]
    usage: Usage | None


class ErrorDetail(TypedDict):
    """``error`` of an error body (OpenAI's shape)."""

    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(TypedDict):
    """An error answer."""

    error: ErrorDetail


__all__ = [
    "CustomToolCallItem",
    "ErrorBody",
    "ErrorDetail",
    "FunctionCallItem",
    "MessageItem",
    "OutputItem",
    "OutputText",
    "ReasoningItem",
    "ReasoningText",
    "Response",
    "Usage",
]
