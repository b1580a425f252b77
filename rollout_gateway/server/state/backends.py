"""Which state backend a gateway's settings select, and its coordination: :func:`state_for`."""

from __future__ import annotations

import sys

from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.state.coordinator import LocalCoordinator, TurnCoordinator
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.store import RolloutStore, StoreUnavailableError


def store_for(config: GatewayConfig) -> RolloutStore:
    """The store ``config`` names: Redis at ``config.state.redis_url`` when set (several
    gateways), SQLite in ``config.state.state_dir`` when set (one gateway, durable), else
    memory (this process only)."""
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


def coordinator_for(store: RolloutStore) -> TurnCoordinator:
    """How a gateway on ``store`` takes turns: with the other gateways on the same Redis
    (:class:`~.redis_backend.coordinator.RedisCoordinator`, one per gateway), else alone
    (:class:`~.coordinator.LocalCoordinator`). A store several gateways share in another
    way comes with its own coordinator (``create_app(config, store=..., coordinator=...)``)."""
    # A RedisStore exists only once its module is loaded (the redis extra may be absent).
    redis_store = sys.modules.get("rollout_gateway.server.state.redis_backend.store")
    if redis_store is not None and isinstance(store, redis_store.RedisStore):
        from rollout_gateway.server.state.redis_backend.coordinator import RedisCoordinator

        return RedisCoordinator(store)
    return LocalCoordinator(store)


def state_for(
    config: GatewayConfig,
    store: RolloutStore | None = None,
    coordinator: TurnCoordinator | None = None,
) -> tuple[RolloutStore, TurnCoordinator]:
    """A gateway's store (``store``, else :func:`store_for`) and its coordination
    (``coordinator``, else :func:`coordinator_for`), chosen once, where the app is
    assembled."""
    store = store if store is not None else store_for(config)
    return store, coordinator if coordinator is not None else coordinator_for(store)


__all__ = ["coordinator_for", "state_for", "store_for"]
