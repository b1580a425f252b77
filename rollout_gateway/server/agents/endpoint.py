"""The agents' turn routes as plain ASGI apps, one per dialect and route kind.

``POST /v1/rollouts/{id}/chat/completions`` (the rollout in the path, its key as bearer)
and ``POST /v1/chat/completions`` (the rollout found by its key) carry the turns of chat
agents; ``{rollout}/v1/messages`` (Anthropic Messages, Claude Code) and
``{rollout}/responses`` (OpenAI Responses, Codex) and their keyed forms carry the turns
of the others (:mod:`~rollout_gateway.server.dialects`). :class:`AgentEndpoint` answers
them with no framework layer per request: it authenticates with the key where the
dialect's clients carry it, hands the turn to :class:`~.chat.ChatTurns`, renders a
refusal in the dialect's error shape (counted in ``/metrics``; a chat refusal exactly as
the other routes render it) and contains an unexpected error as the outermost layer does
(:mod:`~rollout_gateway.server.http.guard`: a short 500 with ``Connection: close``,
counted). The app's dispatcher (:mod:`~rollout_gateway.server.http.dispatch`) calls it
directly; Starlette's router mounts the same objects, so both ways run this one
implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rollout_gateway.server.agents.count_tokens import TokenCounts
from rollout_gateway.server.agents.dialect_turns import CHAT, as_gateway_error
from rollout_gateway.server.agents.request import AgentRequest
from rollout_gateway.server.agents.turn_runner import store_refusal
from rollout_gateway.server.dialects.base import Dialect
from rollout_gateway.server.dialects.errors import GatewayError, RequestError
from rollout_gateway.server.http.guard import log_internal_error, send_internal_error
from rollout_gateway.server.http.responses import ApiError
from rollout_gateway.server.state.store import StoreError

if TYPE_CHECKING:
    from rollout_gateway.server.agents.chat import ChatTurns


class AgentEndpoint:
    """A turn route of a gateway (ASGI app).

    Args:
        chat: the turns of the gateway whose rollouts it serves.
        keyed: the rollout is the one whose key the agent presents (``/v1/messages``...);
            else it is the path's ``rollout_id`` parameter.
        dialect: the wire format of the route (default: chat completions).
        aux: the dialect's side route (``count_tokens``): answered, never a turn.
    """

    def __init__(
        self, chat: ChatTurns, *, keyed: bool, dialect: Dialect = CHAT, aux: bool = False
    ) -> None:
        self.chat = chat
        self.gateway = chat.gateway
        self.keyed = keyed
        self.dialect = dialect
        self.aux = aux
        self.counts = TokenCounts(chat.gateway) if aux else None
        #: Whether the dialect's clients carry the key as a bearer, as chat's do (its
        #: credential is read as chat's is, without the dialect's call and ``x-api-key``).
        self.bearer = dialect is CHAT or type(dialect).credential is Dialect.credential

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway = self.gateway
        dialect = self.dialect
        request = AgentRequest(scope, receive)
        try:
            try:
                key = request.bearer if self.bearer else request.credential(dialect)
                if self.keyed:
                    record = await gateway.keyed_record(key)
                else:
                    rollout_id = scope["path_params"]["rollout_id"]
                    record = await gateway.agent_record(rollout_id, key)
                if self.counts is not None:
                    response = await self.counts.count_tokens(request, record, dialect)
                else:
                    response = await self.chat.handle(request, record, dialect)
            except ApiError as exc:
                response = self._refusal(exc)
            except RequestError as exc:  # a dialect's parse refused the body
                response = self._dialect_error(exc.as_error())
            except StoreError as exc:  # a shared store, reached to find the rollout
                rollout_id = scope.get("path_params", {}).get("rollout_id", "-")
                response = self._refusal(store_refusal(exc, rollout_id))
            except Exception:
                error_id = log_internal_error(scope, gateway.metrics.internal_errors.inc)
                await send_internal_error(send, error_id)
                return
            try:
                await response(scope, receive, send)
            except Exception:
                # The answer has started (a stream): the server can only drop the connection.
                log_internal_error(scope, gateway.metrics.internal_errors.inc)
                raise
        finally:
            request.release()  # its body is answered: its budgets go to the next ones

    def _refusal(self, exc: ApiError) -> Response:
        if self.dialect is CHAT:
            return self.gateway.api_error_response(exc)
        return self._dialect_error(as_gateway_error(exc))

    def _dialect_error(self, error: GatewayError) -> Response:
        """``error`` in the route's dialect (the agent's SDK raises its typed error)."""
        self.gateway.metrics.rejected_requests.inc(str(error.status))
        answer = self.dialect.error_answer(error)
        return Response(
            answer.body,
            status_code=answer.status,
            headers=dict(answer.headers),
            media_type="application/json",
        )


#: The chat routes' endpoint (its name before the other dialects were served).
ChatEndpoint = AgentEndpoint

__all__ = ["AgentEndpoint", "ChatEndpoint"]
