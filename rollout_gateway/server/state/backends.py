"""Which state backend a gateway's settings select: :func:`store_for`."""

from __future__ import annotations

from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.store import GatewayStore, StoreUnavailableError


def store_for(config: GatewayConfig) -> GatewayStore:
    """The store ``config`` names: Redis at ``config.state.redis_url`` when set (several
    gateways, shared), SQLite in ``config.state.state_dir`` when set (one gateway, durable),
    else memory (this process only)."""
    if config.state.redis_url is not None:
        try:
            from rollout_gateway.server.state.redis_backend.store import RedisStore
        except ImportError as exc:
            raise StoreUnavailableError(
                f"Redis needs the redis extra: pip install 'rollout-gateway[redis]' ({exc})"
            ) from None

        return RedisStore(
            config.state.redis_url,
            prefix=config.state.redis_prefix,
            ttl_s=config.registry.rollout_ttl_s,
            lease_s=config.state.redis_lease_s,
        )
    if config.state.state_dir is not None:
        from rollout_gateway.server.state.sqlite import SQLiteStore

        return SQLiteStore(config.state.state_dir, synchronous=config.state.state_sync)
    return MemoryStore()


__all__ = ["store_for"]
