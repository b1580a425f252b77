"""The OpenAI Responses dialect (Codex, the ``openai`` SDK's ``responses`` API).

Routes: ``{rollout}/responses`` (the OpenAI SDK and Codex append ``/responses`` to their
base URL, the rollout's URL) and ``/v1/responses`` at the gateway's root (the rollout
found by its key). The key comes as ``Authorization: Bearer``. Codex's own headers
(``session-id``, ``x-codex-*``, ``originator``...) are not read.

Parsing: :mod:`.responses_parse`; answers: :mod:`.responses_render`; streams:
:mod:`.responses_stream`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rollout_gateway.server.dialects.base import Dialect, ParsedRequest
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.dialects.memo import ParseMemo
from rollout_gateway.server.dialects.responses_parse import (
    SAMPLING_FIELDS,
    ResponsesContext,
    parse_responses_request,
)
from rollout_gateway.server.dialects.responses_render import (
    error_body,
    render_response,
    render_response_json,
)
from rollout_gateway.server.dialects.responses_stream import ResponsesStream
from rollout_gateway.server.dialects.responses_wire import ErrorBody, Response
from rollout_gateway.server.http.jsonio import ConversationText


def _context(request: ParsedRequest) -> ResponsesContext:
    context = request.context
    return context if isinstance(context, ResponsesContext) else ResponsesContext()


class ResponsesDialect(Dialect):
    """OpenAI Responses (see the module doc)."""

    name = "responses"
    routes = ("/responses",)
    keyed_routes = ("/v1/responses",)
    upstream_path = "/responses"
    sampling_fields: ClassVar[frozenset[str]] = SAMPLING_FIELDS

    def parse(
        self, body: dict[str, Any], memo: Any = None, conversation: ConversationText | None = None
    ) -> ParsedRequest:
        memo = memo if isinstance(memo, ParseMemo) else None
        return parse_responses_request(body, memo, conversation)

    def render(self, completion: dict[str, Any], request: ParsedRequest) -> Response:
        return render_response(completion, _context(request))

    def render_json(self, completion: dict[str, Any], request: ParsedRequest) -> bytes:
        return render_response_json(completion, _context(request))

    def stream(self, request: ParsedRequest) -> ResponsesStream:
        return ResponsesStream(_context(request))

    def error_body(self, error: GatewayError) -> ErrorBody:
        return error_body(error)


__all__ = ["ResponsesDialect"]
