"""The wire formats agents speak to a rollout, each a thin edge around one chat turn.

Chat Completions (:mod:`.chat`), Anthropic Messages (:mod:`.anthropic`: Claude Code)
and OpenAI Responses (:mod:`.responses`: Codex). A :class:`~.base.Dialect` parses an
agent's request into the chat request the engine gets and renders the engine's chat
answer, its stream (chunk by chunk) and errors back in the agent's format
(:mod:`.base` says what a dialect is; :mod:`.routes` which path speaks which). No web
framework and no server state: the turn runner calls them.
"""

from __future__ import annotations

from rollout_gateway.server.dialects.anthropic import AnthropicDialect
from rollout_gateway.server.dialects.base import (
    Dialect,
    ErrorAnswer,
    ParsedRequest,
    StreamRenderer,
)
from rollout_gateway.server.dialects.chat import ChatDialect
from rollout_gateway.server.dialects.errors import GatewayError, RequestError
from rollout_gateway.server.dialects.responses import ResponsesDialect
from rollout_gateway.server.dialects.routes import (
    DIALECTS,
    DialectRoute,
    dialect_named,
    match_route,
)

__all__ = [
    "DIALECTS",
    "AnthropicDialect",
    "ChatDialect",
    "Dialect",
    "DialectRoute",
    "ErrorAnswer",
    "GatewayError",
    "ParsedRequest",
    "RequestError",
    "ResponsesDialect",
    "StreamRenderer",
    "dialect_named",
    "match_route",
]
