"""The reference rollout gateway server (protocol v1) in front of OpenAI-compatible upstreams.

Light to import: Starlette, httpx and uvicorn only (no verifiers).

* :func:`create_app` builds the ASGI app from a :class:`GatewayConfig`;
* :func:`serve` runs an app in the foreground with uvicorn;
* :func:`running_server` / :func:`server_thread` run one in-process (tests, demos).

Where things are, in the order a chat turn meets them: :mod:`.runner` (uvicorn) and
:mod:`.app` (the gateway's state, the app that wires the layers, its operational routes);
:mod:`.http` (connection limits, :mod:`.http.guard`, bounded bodies, and
:mod:`.http.dispatch`, the agents' chat routes' lean path); :mod:`.agents`
(:mod:`.agents.endpoint`, then :mod:`.agents.chat`: the request in its dialect, retries
joined; :mod:`.agents.turn_runner`: one turn, budgets checked by :mod:`.agents.limits`);
:mod:`.engines` (:mod:`.engines.turn`: the engine call and its step, the upstream
clients, token-in mode); :mod:`.recording` (:mod:`.recording.recorder` and
:mod:`.recording.token_branches`: the trajectory);
:mod:`.state` (the registry of rollouts, retries, policy versions, and the store they are
kept in: memory or SQLite); :mod:`.control`
(register, trajectory, cancel, unregister, exits, policy version); :mod:`.ops` (metrics,
memory, the garbage collector). :mod:`.context` is the gateway as the agent API and the
control plane see it.
"""

from __future__ import annotations

from rollout_gateway.options import ConfigError
from rollout_gateway.server.app import Gateway, create_app
from rollout_gateway.server.config import (
    DEFAULT_KEEP_ALIVE_S,
    ConnectionSettings,
    GatewayConfig,
    IntakeLimits,
    RegistrySettings,
    RolloutLimits,
    StateSettings,
    UpstreamSettings,
)
from rollout_gateway.server.runner import running_server, serve, server_thread

__all__ = [
    "DEFAULT_KEEP_ALIVE_S",
    "ConfigError",
    "ConnectionSettings",
    "Gateway",
    "GatewayConfig",
    "IntakeLimits",
    "RegistrySettings",
    "RolloutLimits",
    "StateSettings",
    "UpstreamSettings",
    "create_app",
    "running_server",
    "serve",
    "server_thread",
]
