"""One gateway's coordination on Redis: :class:`RedisCoordinator`.

A claim takes the rollout's lease (:data:`~.scripts.CLAIM`; renewed while the turn runs,
:mod:`.leases`) and reads, in the same round trip, what this gateway's copy missed: with
gateways taking turns of one rollout round robin, the gateway claiming a turn is usually
behind (another gateway recorded the last turn), and the claim answers the rollout's
fields and the steps stored since the copy's, with the last step's check state
(:mod:`.check_state`). A gateway waiting for another's lease is woken by the release
(:mod:`.events`). Exit reports are numbered by Redis once for every gateway
(:mod:`.exits`); every gateway hears of them, of removed rollouts and of policy
announcements through the events channel.
"""

from __future__ import annotations

import asyncio
import contextlib

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.state.coordinator import Claim, HeldCopy
from rollout_gateway.server.state.redis_backend.events import RECHECK_S, EventListener
from rollout_gateway.server.state.redis_backend.store import RedisStore
from rollout_gateway.server.state.shared import SharedCoordinator
from rollout_gateway.server.state.store import (
    PolicyState,
    RolloutRow,
    StoreContents,
    StoreEvents,
    UnknownRolloutError,
)


class RedisCoordinator(SharedCoordinator):
    """One gateway's turns, exit reports and events on a :class:`RedisStore`."""

    store: RedisStore

    def __init__(self, store: RedisStore) -> None:
        super().__init__(store)
        self._listener = EventListener(
            store.connection, store.channel, load_policy=store.load_policy,
            exits_after=store.exits.after,
        )  # fmt: skip

    def watch(self, events: StoreEvents) -> None:
        """Tell ``events`` of exit reports, removed rollouts and policy announcements
        (from :meth:`open` on: call before it)."""
        super().watch(events)
        self._listener.events = events

    async def open(self, contents: StoreContents) -> list[RolloutRow]:
        """Start following the other gateways' changes (when watched), from the exit
        reports the store held."""
        rows = await super().open(contents)
        self._listener.start(contents.exit_cursor)
        return rows

    async def close(self) -> None:
        """Stop following changes and renewing leases."""
        await super().close()
        self.store.leases.stop_all()
        await self._listener.stop()

    async def claim(self, rollout_id: str, owner: str, lease_s: float, held: HeldCopy) -> Claim:
        """Take the lease (at most ``lease_s``, at most the store's own lease, renewed
        while held), waiting while another gateway holds it; what ``held`` missed comes
        with it."""
        store = self.store
        lease_ms = max(1, int(min(lease_s, store.lease_s) * 1000))
        keys = [*store.keys(rollout_id), f"{store.prefix}policy"]
        args = [owner, lease_ms, store.ttl_ms, str(held.revision), str(held.steps)]
        while True:
            waker = self._listener.waker(rollout_id)
            reply = await store.run("CLAIM", keys, args)
            if reply[0] == b"gone":
                raise UnknownRolloutError(rollout_id)
            if reply[0] == b"ok":
                self._listener.done_waiting(rollout_id, waker)
                store.leases.took(rollout_id, owner, lease_ms)
                if reply[2] is not None:
                    self._listener.policy_seen(PolicyState(int(reply[2]), float(reply[3])))
                return self._claimed(rollout_id, reply, held)
            left_s = max(0.0, int(reply[1]) / 1000)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(RECHECK_S, left_s + 0.01)):
                    await waker.wait()

    def _claimed(self, rollout_id: str, reply: list[object], held: HeldCopy) -> Claim:
        revision = int(reply[1])  # type: ignore[call-overload]
        if len(reply) <= 4:  # the copy is current
            return Claim(revision)
        fields: list[bytes] = reply[4]  # type: ignore[assignment]
        row = self.store.row_of(rollout_id, fields)
        if row is None:
            raise UnknownRolloutError(rollout_id)
        steps = self.store.steps_of(rollout_id, reply[5], held.steps, fields[8])  # type: ignore[arg-type]
        return Claim(revision, row, steps)

    async def release(self, rollout_id: str, owner: str, *, delivered: bool | None) -> None:
        """Drop the lease if ``owner`` holds it from this gateway (a waiting gateway is
        told), noting a delivered answer (one script; none when a commit ended the claim
        already)."""
        store = self.store
        if store.leases.owner(rollout_id) != owner:
            return
        store.leases.dropped(rollout_id)
        keys = [store.keys(rollout_id)[2], store.keys(rollout_id)[0]]
        args = [owner, store.channel, rollout_id, "1" if delivered else "0"]
        await store.run("RELEASE", keys, args)

    async def number_exit(self, report: ExitReport) -> ExitReport | None:
        """Numbered once for every gateway (one script); every gateway's listener hands
        it to its events."""
        return await self.store.exits.report(report, self.store.keys(report["rollout_id"])[0])


__all__ = ["RedisCoordinator"]
