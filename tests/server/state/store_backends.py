"""The state backends the contract tests run on, and how each is made and reopened.

A backend is a :class:`Backend`: ``make(directory)`` builds a fresh, unopened store;
``reopen(store, directory)`` closes it and builds another on what the first one stored
(a restart; ``None`` when nothing survives the process); ``peer(store, directory)`` is
another gateway's handle on a shared store (``None`` when it is not shared). A new
backend joins the contract suite (``test_store_contract.py``) by adding itself to
:data:`BACKENDS`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.sqlite import SQLiteStore
from rollout_gateway.server.state.store import GatewayStore


@dataclass(frozen=True)
class Backend:
    name: str
    make: Callable[[Path], GatewayStore]
    #: Builds a store on what ``store`` stored, after closing it (``None``: not durable).
    reopen: Callable[[GatewayStore, Path], Awaitable[GatewayStore]] | None = None
    #: Another gateway's handle on what ``store`` holds (``None``: not shared).
    peer: Callable[[GatewayStore, Path], GatewayStore] | None = None


def _memory(directory: Path) -> GatewayStore:
    return MemoryStore()


def _shared_memory(directory: Path) -> GatewayStore:
    return MemoryStore(shared=True)


def _sqlite(directory: Path) -> GatewayStore:
    return SQLiteStore(directory / "state")


async def _sqlite_reopen(store: GatewayStore, directory: Path) -> GatewayStore:
    await store.close()
    return _sqlite(directory)


def _sqlite_full(directory: Path) -> GatewayStore:
    return SQLiteStore(directory / "state", synchronous="full")  # its writer thread


async def _sqlite_full_reopen(store: GatewayStore, directory: Path) -> GatewayStore:
    await store.close()
    return _sqlite_full(directory)


BACKENDS: list[Backend] = [
    Backend("memory", _memory),
    Backend("memory-shared", _shared_memory, peer=lambda store, directory: store),
    Backend("sqlite", _sqlite, reopen=_sqlite_reopen),
    Backend("sqlite-full", _sqlite_full, reopen=_sqlite_full_reopen),
]


__all__ = ["BACKENDS", "Backend"]
