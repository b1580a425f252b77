"""Gateways that share one store: :class:`SharedCoordinator`, what they have in common.

Any request of any rollout may reach any gateway, so a gateway's copies are a cache of
the store: a rollout it does not hold is read from the store (:meth:`~SharedCoordinator.
find`), a copy is compared with the stored revision before it is read
(:meth:`~SharedCoordinator.catch_up`) or used for a turn (the claim, one turn of a rollout
at a time anywhere), a rollout idle here is deleted only when idle at every gateway, exit
reports are numbered by the store once for all gateways and reach every gateway's board
through the events (:meth:`~SharedCoordinator.watch`), and the policy version is read
from the store. A backend implements the claim, its release, the numbering and the
events: :mod:`.redis_backend` (gateways anywhere; for tests of gateways in one process,
``tests/support/shared_memory.py``).
"""

from __future__ import annotations

import abc
import asyncio
import logging

from rollout_gateway.exits import ExitBoard
from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.digests import share_seed
from rollout_gateway.server.state.coordinator import Claim, HeldCopy, TurnCoordinator
from rollout_gateway.server.state.store import (
    RolloutRow,
    RolloutStore,
    StoreContents,
    StoreError,
    StoreEvents,
    UnknownRolloutError,
)

logger = logging.getLogger("rollout_gateway.server")


class SharedCoordinator(TurnCoordinator):
    """The coordination of a gateway on a store other gateways share (see the module
    doc); a backend adds :meth:`claim`, :meth:`release` and :meth:`number_exit`, and
    tells :attr:`events` what the others change."""

    def __init__(self, store: RolloutStore) -> None:
        super().__init__(store)
        #: Told what the other gateways change (``None``: nobody listens).
        self.events: StoreEvents | None = None
        self._posts: set[asyncio.Task[None]] = set()

    @abc.abstractmethod
    async def number_exit(self, report: ExitReport) -> ExitReport | None:
        """Keep ``report`` (its ``seq`` ignored) as its rollout's report, merged over the
        stored one (:func:`rollout_gateway.exits.merged_report`: the store may know of a
        report this gateway has not heard of yet), numbered once for every gateway; the
        report as kept (``None``: the merge dropped it). Every gateway's events hear of
        it. Raises :class:`~.store.UnknownRolloutError`."""

    def exit_board(self) -> ExitBoard:
        """A board whose reports the store numbers (each reaches every gateway's board,
        this one's included, in number order)."""
        self.board = ExitBoard(publish=self._publish)
        return self.board

    def watch(self, events: StoreEvents) -> None:
        """Tell ``events`` what other gateways change."""
        self.events = events

    async def open(self, contents: StoreContents) -> list[RolloutRow]:
        """Key the digests a step is stored with as every gateway does; hold no rollout
        yet (each is read when first asked for)."""
        share_seed(self.store.secret)
        return []

    async def close(self) -> None:
        """Wait for the reports being posted."""
        while self._posts:
            await asyncio.gather(*self._posts, return_exceptions=True)

    def vouches_for(self, revision: int) -> bool:
        """Never: another gateway may have changed it."""
        return False

    async def catch_up(self, rollout_id: str, held: HeldCopy) -> Claim:
        """The stored rollout when its revision is not the copy's."""
        row = await self.store.load_rollout(rollout_id)
        if row is None:
            raise UnknownRolloutError(rollout_id)
        return Claim(row.revision, None if row.revision == held.revision else row)

    async def find(self, rollout_id: str) -> RolloutRow | None:
        """From the store."""
        return await self.store.load_rollout(rollout_id)

    async def find_key(self, key_digest: str) -> str | None:
        """From the store."""
        return await self.store.rollout_for_key(key_digest)

    async def may_delete(self, rollout_id: str, *, idle_s: float, now: float) -> bool:
        """When no gateway changed it for ``idle_s`` (the stored ``updated_at``)."""
        row = await self.store.load_rollout(rollout_id)
        changed = row.counters.get("updated_at", 0.0) if row is not None else 0.0
        return now - changed > idle_s

    async def report_exit(self, report: ExitReport) -> None:
        """Numbered by the store, kept there when this returns (else the store's error);
        the boards hear of it through the events, in number order (a board taking it here
        at once could take it before an earlier report still on its way)."""
        await self.number_exit(report)

    def dropped(self, rollout_id: str) -> None:
        """Nothing: the rollout may live on at other gateways."""

    async def refresh_policy(self) -> None:
        """The version in effect as stored (announced at any gateway)."""
        if self.events is not None:
            self.events.policy_announced(await self.store.load_policy())

    def _publish(self, report: ExitReport) -> None:
        """A report the board made (a refusal of the gateway's), numbered by the store in
        the background: a refusal is told on the exit channel beside the agent's answer."""

        async def post() -> None:
            try:
                await self.number_exit(report)
            except StoreError as exc:
                logger.warning("rollout=%s report not stored: %s", report["rollout_id"], exc)

        task = asyncio.get_running_loop().create_task(post())
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)


__all__ = ["SharedCoordinator"]
