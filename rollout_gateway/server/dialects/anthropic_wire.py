"""Anthropic Messages wire shapes the gateway writes (answers, stream events, errors).

They live beside the one adapter that writes them: the agents that read them bring their
own types (the ``anthropic`` SDKs, Claude Code), which the tests check these against.
Requests are read as the agent's JSON (:mod:`.anthropic_parse`), field by field.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

#: Anthropic's ``stop_reason`` values the gateway answers.
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


class TextBlock(TypedDict):
    """``{"type": "text", "text"}``."""

    type: Literal["text"]
    text: str


class ThinkingBlock(TypedDict):
    """The engine's reasoning. ``signature`` is empty: the gateway is the provider and
    signs nothing; the agent echoes the block back as it got it."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseBlock(TypedDict):
    """A tool call: ``input`` is the call's arguments parsed (``{}`` when they are not a
    JSON object)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(TypedDict):
    """Token counts. ``input_tokens`` leaves out cache reads, which
    ``cache_read_input_tokens`` counts when the engine reports them."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: NotRequired[int]


class Message(TypedDict):
    """A whole answer (``POST /v1/messages`` without ``stream``)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class ErrorDetail(TypedDict):
    """``error`` of an error body: Anthropic's ``type`` for the status, the message, and
    the gateway's own code under ``details.error_code`` (where the SDK looks for one)."""

    type: str
    message: str
    details: NotRequired[dict[str, str]]


class ErrorBody(TypedDict):
    """An error answer, also the payload of an in-stream ``event: error``."""

    type: Literal["error"]
    error: ErrorDetail


class TokenCount(TypedDict):
    """The answer of ``POST /v1/messages/count_tokens``."""

    input_tokens: int


__all__ = [
    "ContentBlock",
    "ErrorBody",
    "ErrorDetail",
    "Message",
    "StopReason",
    "TextBlock",
    "ThinkingBlock",
    "TokenCount",
    "ToolUseBlock",
    "Usage",
]
