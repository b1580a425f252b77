"""Which state backend a gateway's settings select: :func:`store_for`."""

from __future__ import annotations

from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.store import GatewayStore


def store_for(config: GatewayConfig) -> GatewayStore:
    """The store ``config`` names: SQLite in ``config.state_dir`` when set (one gateway,
    durable), else memory (this process only)."""
    if config.state_dir is not None:
        from rollout_gateway.server.state.sqlite import SQLiteStore

        return SQLiteStore(config.state_dir, synchronous=config.state_sync)
    return MemoryStore()


__all__ = ["store_for"]
