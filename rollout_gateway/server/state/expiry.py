"""Expired rollouts deleted from the store in the background.

A rollout idle past the registry's TTL is dropped from this gateway's copies at once; its
stored row goes in a background task, when the coordinator says no other gateway used it
meanwhile. A new registration of the same id waits for that deletion
(:meth:`ExpiredDeletions.settled`), and shutdown waits for all of them
(:meth:`ExpiredDeletions.drain`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollout_gateway.server.state.coordinator import TurnCoordinator
from rollout_gateway.server.state.registry import RolloutRegistry
from rollout_gateway.server.state.store import RolloutStore, StoreError

logger = logging.getLogger("rollout_gateway.server")


class ExpiredDeletions:
    """The background deletions of expired rollouts, one task per rollout id.

    Args:
        registry: the records (its ``ttl_s`` is how long a rollout may stay idle).
        store: where the expired rollouts' rows are deleted.
        coordinator: says whether another gateway used a rollout since.
        wall_clock: Unix time (stored times).
    """

    def __init__(
        self,
        registry: RolloutRegistry,
        store: RolloutStore,
        coordinator: TurnCoordinator,
        wall_clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._store = store
        self._coordinator = coordinator
        self._wall_clock = wall_clock
        self._pending: dict[str, asyncio.Task[bool]] = {}

    def start(self, rollout_id: str) -> None:
        """Delete ``rollout_id``'s stored row in the background."""
        task = asyncio.get_running_loop().create_task(self._delete(rollout_id))
        self._pending[rollout_id] = task
        task.add_done_callback(lambda _: self._forget(rollout_id, task))

    async def settled(self, rollout_id: str) -> None:
        """Wait for a deletion of ``rollout_id`` under way, if any (a cancelled waiter
        leaves the deletion running)."""
        pending = self._pending.get(rollout_id)
        if pending is not None:
            await asyncio.shield(pending)

    async def drain(self) -> None:
        """Wait for every deletion (at shutdown)."""
        while self._pending:
            await asyncio.gather(*self._pending.values(), return_exceptions=True)

    async def _delete(self, rollout_id: str) -> bool:
        try:
            ttl_s, now = self._registry.ttl_s, self._wall_clock()
            if not await self._coordinator.may_delete(rollout_id, idle_s=ttl_s, now=now):
                return False  # only dropped from this gateway's copies
            return await self._store.delete_rollout(rollout_id)
        except StoreError as exc:  # kept: it expires again after a restart
            logger.warning("rollout=%s expired but not deleted from the store: %s", rollout_id, exc)
            return False

    def _forget(self, rollout_id: str, task: asyncio.Task[bool]) -> None:
        if self._pending.get(rollout_id) is task:
            del self._pending[rollout_id]


__all__ = ["ExpiredDeletions"]
