"""The state backends the contract tests run on, and how each is made and reopened.

A backend is a :class:`Backend`: ``make(directory)`` builds a fresh, unopened store;
``reopen(store, directory)`` closes it and builds another on what the first one stored
(a restart; ``None`` when nothing survives the process); ``peer(store, directory)`` is
another gateway's handle on a shared store (``None`` when it is not shared). A new
backend joins the contract suite (``test_store_contract.py``) by adding itself to
:data:`BACKENDS`.

The Redis backend runs on one real ``redis-server`` for the session
(:func:`.redis_fixtures.shared_redis_url`), each store under a key prefix of its own; it
is left out when redis-py is not installed.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from support.shared_memory import SharedMemoryStore

from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.sqlite import SQLiteStore
from rollout_gateway.server.state.store import RolloutStore


@dataclass(frozen=True)
class Backend:
    name: str
    make: Callable[[Path], RolloutStore]
    #: Builds a store on what ``store`` stored, after closing it (``None``: not durable).
    reopen: Callable[[RolloutStore, Path], Awaitable[RolloutStore]] | None = None
    #: Another gateway's handle on what ``store`` holds (``None``: not shared).
    peer: Callable[[RolloutStore, Path], RolloutStore] | None = None


def _memory(directory: Path) -> RolloutStore:
    return MemoryStore()


def _shared_memory(directory: Path) -> RolloutStore:
    return SharedMemoryStore()


def _sqlite(directory: Path) -> RolloutStore:
    return SQLiteStore(directory / "state")


async def _sqlite_reopen(store: RolloutStore, directory: Path) -> RolloutStore:
    await store.close()
    return _sqlite(directory)


def _sqlite_full(directory: Path) -> RolloutStore:
    return SQLiteStore(directory / "state", synchronous="full")  # its writer thread


async def _sqlite_full_reopen(store: RolloutStore, directory: Path) -> RolloutStore:
    await store.close()
    return _sqlite_full(directory)


BACKENDS: list[Backend] = [
    Backend("memory", _memory),
    Backend("memory-shared", _shared_memory, peer=lambda store, directory: store),
    Backend("sqlite", _sqlite, reopen=_sqlite_reopen),
    Backend("sqlite-full", _sqlite_full, reopen=_sqlite_full_reopen),
]

_prefixes = itertools.count()


def _redis(directory: Path) -> RolloutStore:
    from rollout_gateway.server.state.redis_backend.store import RedisStore

    from .redis_fixtures import shared_redis_url

    return RedisStore(shared_redis_url(), prefix=f"contract{next(_prefixes)}:")


def _redis_peer(store: RolloutStore, directory: Path) -> RolloutStore:
    from rollout_gateway.server.state.redis_backend.store import RedisStore

    assert isinstance(store, RedisStore)
    return RedisStore(store.url, prefix=store.prefix)


async def _redis_reopen(store: RolloutStore, directory: Path) -> RolloutStore:
    await store.close()
    return _redis_peer(store, directory)


if importlib.util.find_spec("redis") is not None:
    BACKENDS.append(Backend("redis", _redis, reopen=_redis_reopen, peer=_redis_peer))


__all__ = ["BACKENDS", "Backend"]
