"""The agents' chat-completions routes as one plain ASGI app.

``POST /v1/rollouts/{id}/chat/completions`` (the rollout in the path, its key as bearer)
and ``POST /v1/chat/completions`` (the rollout found by its key) carry every turn of every
rollout. :class:`ChatEndpoint` answers them with no framework layer per request: it
authenticates, hands the turn to :class:`~.chat.ChatTurns`, renders a refusal as the
other routes do (counted in ``/metrics``) and contains an unexpected error as the
outermost layer does (:mod:`~rollout_gateway.server.http.guard`: a short 500 with
``Connection: close``, counted). The app's dispatcher
(:mod:`~rollout_gateway.server.http.dispatch`) calls it directly; Starlette's router
mounts the same object, so both ways run this one implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from rollout_gateway.server.agents.chat import store_refusal
from rollout_gateway.server.agents.request import AgentRequest
from rollout_gateway.server.http.guard import log_internal_error, send_internal_error
from rollout_gateway.server.http.responses import ApiError
from rollout_gateway.server.state.store import StoreError

if TYPE_CHECKING:
    from rollout_gateway.server.agents.chat import ChatTurns


class ChatEndpoint:
    """A chat-completions route of a gateway (ASGI app).

    Args:
        chat: the chat turns of the gateway whose rollouts it serves.
        keyed: the rollout is the one whose key is the bearer token
            (``/v1/chat/completions``); else it is the path's ``rollout_id`` parameter.
    """

    def __init__(self, chat: ChatTurns, *, keyed: bool) -> None:
        self.chat = chat
        self.gateway = chat.gateway
        self.keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway = self.gateway
        request = AgentRequest(scope, receive)
        try:
            try:
                if self.keyed:
                    record = await gateway.keyed_record(request.bearer)
                else:
                    rollout_id = scope["path_params"]["rollout_id"]
                    record = await gateway.agent_record(rollout_id, request.bearer)
                response = await self.chat.handle(request, record)
            except ApiError as exc:
                response = gateway.api_error_response(exc)
            except StoreError as exc:  # a shared store, reached to find the rollout
                rollout_id = scope.get("path_params", {}).get("rollout_id", "-")
                response = gateway.api_error_response(store_refusal(exc, rollout_id))
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


__all__ = ["ChatEndpoint"]
