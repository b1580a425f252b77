"""Which dialect a request path speaks, and for which rollout.

Each dialect's routes are relative to a rollout's URL (``/v1/rollouts/{id}``, what an
agent is given as its base URL) or at the gateway's root, where the rollout is found by
the key the agent presents (agents whose base URL cannot carry the id):

========================================  ==========  ================================
path                                      dialect     turn?
========================================  ==========  ================================
``/v1/rollouts/{id}/chat/completions``    chat        a turn
``/v1/rollouts/{id}/v1/messages``         anthropic   a turn
``/v1/rollouts/{id}/v1/messages/count_tokens``  anthropic  answered, never recorded
``/v1/rollouts/{id}/responses``           responses   a turn
``/v1/chat/completions``                  chat        a turn (by key)
``/v1/messages``                          anthropic   a turn (by key)
``/v1/messages/count_tokens``             anthropic   answered, never recorded (by key)
``/v1/responses``                         responses   a turn (by key)
========================================  ==========  ================================

A query string is ignored (Claude Code posts ``/v1/messages?beta=true``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rollout_gateway.server.dialects.anthropic import AnthropicDialect
from rollout_gateway.server.dialects.base import Dialect
from rollout_gateway.server.dialects.chat import ChatDialect
from rollout_gateway.server.dialects.responses import ResponsesDialect

#: Every dialect the gateway serves.
DIALECTS: tuple[Dialect, ...] = (ChatDialect(), AnthropicDialect(), ResponsesDialect())

_ROLLOUT_PREFIX = "/v1/rollouts/"


@dataclass(frozen=True, slots=True)
class DialectRoute:
    """What a path is: a ``dialect``'s turn (or, ``aux``, its side route answered and
    never recorded), for ``rollout_id`` (``None``: the rollout is found by its key)."""

    dialect: Dialect
    aux: bool = False
    rollout_id: str | None = None


def _table(keyed: bool) -> dict[str, DialectRoute]:
    table: dict[str, DialectRoute] = {}
    for dialect in DIALECTS:
        turns = dialect.keyed_routes if keyed else dialect.routes
        sides = dialect.keyed_aux_routes if keyed else dialect.aux_routes
        table.update((path, DialectRoute(dialect)) for path in turns)
        table.update((path, DialectRoute(dialect, aux=True)) for path in sides)
    return table


_IN_ROLLOUT = _table(keyed=False)
_AT_ROOT = _table(keyed=True)
_BY_NAME = {dialect.name: dialect for dialect in DIALECTS}


def match_route(path: str) -> DialectRoute | None:
    """The route of ``path`` (``None``: no dialect's). The rollout id is not checked
    here (the caller checks it as for every rollout path)."""
    if len(path) <= _CACHED_PATH_CHARS:  # a rollout's agent posts to the same path each turn
        return _cached_route(path)
    return _route(path)


def _route(path: str) -> DialectRoute | None:
    path = path.partition("?")[0]
    route = _AT_ROOT.get(path)
    if route is not None:
        return route
    if not path.startswith(_ROLLOUT_PREFIX):
        return None
    rollout_id, slash, tail = path[len(_ROLLOUT_PREFIX) :].partition("/")
    if not slash or not rollout_id:
        return None
    route = _IN_ROLLOUT.get("/" + tail)
    if route is None:
        return None
    return DialectRoute(route.dialect, route.aux, rollout_id)


#: Paths up to this long have their route cached (the last :data:`_CACHED_PATHS` paths:
#: a few MB at most, whatever paths agents send).
_CACHED_PATH_CHARS = 512
_CACHED_PATHS = 4096
_cached_route = functools.lru_cache(maxsize=_CACHED_PATHS)(_route)


def dialect_named(name: str) -> Dialect:
    """The dialect recorded as ``name`` (``KeyError`` if none)."""
    return _BY_NAME[name]


__all__ = ["DIALECTS", "DialectRoute", "dialect_named", "match_route"]
