"""The turn leases one gateway holds in Redis: :class:`Leases`.

A claim takes a rollout's lease for ``lease_s`` (:data:`~.scripts.CLAIM`); while the turn
runs, the lease is renewed every third of its length (no task at all for a turn shorter
than that: a timer, cancelled when the turn ends). A gateway that dies stops renewing, and
its lease runs out: the rollout's next turn, on any gateway, claims it then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from rollout_gateway.server.state.store import StoreUnavailableError

#: Renews ``(rollout_id, owner, lease_ms)``; false once the lease is not the owner's.
Renew = Callable[[str, str, int], Awaitable[bool]]


class Leases:
    """Who holds each lease taken from this gateway, and the timers renewing them."""

    def __init__(self, renew: Renew) -> None:
        self._renew_call = renew
        self._owners: dict[str, str] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def owner(self, rollout_id: str) -> str | None:
        """The owner holding the rollout's lease from here (``None``: not held here)."""
        return self._owners.get(rollout_id)

    def took(self, rollout_id: str, owner: str, lease_ms: int) -> None:
        """``owner`` took the lease: renew it while held."""
        self._owners[rollout_id] = owner
        self._renew_later(rollout_id, owner, lease_ms)

    def dropped(self, rollout_id: str) -> None:
        """The lease was released (or the rollout removed): stop renewing it."""
        self._owners.pop(rollout_id, None)
        timer = self._timers.pop(rollout_id, None)
        if timer is not None:
            timer.cancel()

    def stop_all(self) -> None:
        """Stop every renewal (the store closes, or its event loop ended)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._owners.clear()

    def _renew_later(self, rollout_id: str, owner: str, lease_ms: int) -> None:
        def renew() -> None:
            task = asyncio.ensure_future(self._renew(rollout_id, owner, lease_ms))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

        old = self._timers.pop(rollout_id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._timers[rollout_id] = loop.call_later(lease_ms / 3000, renew)

    async def _renew(self, rollout_id: str, owner: str, lease_ms: int) -> None:
        if self._owners.get(rollout_id) != owner:
            return
        try:
            if not await self._renew_call(rollout_id, owner, lease_ms):
                return  # lost: the commit says so
        except StoreUnavailableError:
            pass  # tried again a third of a lease later; the commit fails if it ran out
        if self._owners.get(rollout_id) == owner:
            self._renew_later(rollout_id, owner, lease_ms)


__all__ = ["Leases", "Renew"]
