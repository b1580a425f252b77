"""The gateway app's lean path: the agents' chat routes skip Starlette's per-request layers.

Every turn of every rollout is one ``POST`` to a chat-completions route. Through
Starlette it passes four nested ASGI layers (error middleware, :mod:`.guard`, exception
middleware, router), a route match against every route in turn, and a ``Request``
object; at 64 concurrent rollouts that fixed Python cost per request was the largest part
of the gateway's CPU per turn that a plain proxy does not pay
(``benchmarks/gateway_overhead.py``). :class:`GatewayApp` is the gateway's Starlette app
with one change: a ``POST`` to exactly ``/v1/chat/completions`` or
``/v1/rollouts/{id}/chat/completions`` (``{id}`` one path segment, nothing
percent-encoded) goes straight to its
:class:`~rollout_gateway.server.agents.endpoint.ChatEndpoint`, which keeps every guarantee
of those layers itself. The other dialects' turn routes (Anthropic Messages
``/v1/rollouts/{id}/v1/messages`` and ``/v1/messages``, its ``count_tokens``, OpenAI
Responses ``/v1/rollouts/{id}/responses`` and ``/v1/responses``: see
:mod:`~rollout_gateway.server.dialects.routes`, whose table this reads; a query string
is ignored) take the same lean path to their own endpoints, after the chat checks.
Anything else (other paths and methods, an encoded byte in the path, lifespan) takes
Starlette's usual way, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_gateway.protocol import BEARER_CHAT_COMPLETIONS_PATH
from rollout_gateway.server.dialects.routes import match_route

#: A dialect route's app: by the dialect's name, whether it is the side route
#: (``count_tokens``), and whether the rollout is found by its key.
DialectApps = Mapping[tuple[str, bool, bool], ASGIApp]

_ROLLOUTS = "/v1/rollouts/"
_CHAT = "/chat/completions"


class GatewayApp(Starlette):
    """The gateway's Starlette app, with its chat routes on the lean path.

    Args:
        chat: the app of ``POST /v1/rollouts/{id}/chat/completions``.
        chat_by_key: the app of ``POST /v1/chat/completions``.
        dialects: the apps of the other dialects' routes (:data:`DialectApps`).
        **kwargs: Starlette's (routes, middleware, exception handlers, lifespan); the
            routes should mount the same two apps, so that other methods on those paths
            get Starlette's answer (405).
    """

    def __init__(
        self,
        *,
        chat: ASGIApp,
        chat_by_key: ASGIApp,
        dialects: DialectApps | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.chat = chat
        self.chat_by_key = chat_by_key
        self.dialects = dict(dialects or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == BEARER_CHAT_COMPLETIONS_PATH:
                await self.chat_by_key(scope, receive, send)
                return
            if path.startswith(_ROLLOUTS) and path.endswith(_CHAT):
                rollout_id = path[len(_ROLLOUTS) : -len(_CHAT)]
                raw_path = scope.get("raw_path") or b""
                if rollout_id and "/" not in rollout_id and b"%" not in raw_path:
                    scope["path_params"] = {"rollout_id": rollout_id}
                    await self.chat(scope, receive, send)
                    return
            elif self.dialects and await self._dialect(scope, receive, send):
                return
        await super().__call__(scope, receive, send)

    async def _dialect(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer a POST to another dialect's route; whether it was one."""
        route = match_route(scope["path"])
        if route is None or b"%" in (scope.get("raw_path") or b""):
            return False
        keyed = route.rollout_id is None
        app = self.dialects.get((route.dialect.name, route.aux, keyed))
        if app is None:
            return False
        if not keyed:
            scope["path_params"] = {"rollout_id": route.rollout_id}
        await app(scope, receive, send)
        return True


__all__ = ["GatewayApp"]
