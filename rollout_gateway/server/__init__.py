"""The reference rollout gateway server (protocol v1) in front of OpenAI-compatible upstreams.

Light to import: Starlette, httpx and uvicorn only (no verifiers).

* :func:`create_app` builds the ASGI app from a :class:`GatewayConfig`;
* :func:`serve` runs an app in the foreground with uvicorn;
* :func:`running_server` / :func:`server_thread` run one in-process (tests, demos).

Where things are: :mod:`.app` (the gateway's state, the app and its operational routes),
:mod:`.control_plane` (register, trajectory, cancel, unregister, exits, policy version),
:mod:`.exit_stream`, :mod:`.dispatch` and :mod:`.chat_endpoint` (the agents' chat routes'
lean path), :mod:`.chat` / :mod:`.engine_turn` / :mod:`.token_in` (a turn), :mod:`.recorder`
and :mod:`.token_branches` (the trajectory), :mod:`.guard` and :mod:`.limits` (connections
and bodies).
"""

from __future__ import annotations

from rollout_gateway.server.app import Gateway, create_app
from rollout_gateway.server.config import DEFAULT_KEEP_ALIVE_S, GatewayConfig
from rollout_gateway.server.runner import running_server, serve, server_thread

__all__ = [
    "DEFAULT_KEEP_ALIVE_S",
    "Gateway",
    "GatewayConfig",
    "create_app",
    "running_server",
    "serve",
    "server_thread",
]
