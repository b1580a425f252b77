"""The coordination seam: who runs a rollout's turn, who numbers exit reports, and what
other gateways changed (:class:`TurnCoordinator`), apart from what is stored (:mod:`.store`).

A gateway alone on its store (memory, SQLite) is the only writer: its copies of the
rollouts are the stored ones, it numbers its exit reports itself, and nobody else changes
anything (:class:`LocalCoordinator`). Gateways sharing a store (Redis) take turns of a
rollout one at a time, wherever they run, read what another gateway changed, and number
exit reports once for all (:mod:`.shared`: :class:`~.shared.SharedCoordinator`, and the
Redis backend's :class:`~.redis_backend.coordinator.RedisCoordinator`). The coordinator is
chosen once, where the app is assembled (:meth:`~.store.RolloutStore.coordinator`); the
rest of the gateway asks it and never what kind it is.

A claim returns what the caller missed: the caller says what its copy holds
(:class:`HeldCopy`) and the claim answers the stored revision and, when the copy is
behind, the stored rollout and the steps stored since (:class:`Claim`), read with the
claim where the backend can (Redis: in the claim's own round trip).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from rollout_gateway.exits import ExitBoard
from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import StepDelta
from rollout_gateway.server.state.store import (
    RolloutRow,
    RolloutStore,
    StoreContents,
    StoreError,
    StoreEvents,
    UnknownRolloutError,
)

logger = logging.getLogger("rollout_gateway.server")


@dataclass(frozen=True, slots=True)
class HeldCopy:
    """What a gateway's copy of a rollout holds: the stored revision it reflects (``-1``:
    none it can vouch for: never loaded, or left stale by a failed write) and its steps."""

    revision: int
    steps: int


@dataclass(slots=True)
class Claim:
    """What a claim (or a catch-up) found."""

    #: The rollout's stored revision.
    revision: int
    #: The stored rollout, when the caller's copy is behind (``None``: it is current).
    row: RolloutRow | None = None
    #: The steps stored from :attr:`HeldCopy.steps` on, when they were read with the
    #: claim (``None``: not read; the caller reads the steps it needs).
    steps: list[StepDelta] | None = None


class TurnCoordinator(abc.ABC):
    """How a gateway takes turns, numbers exit reports and hears of other gateways.

    Args:
        store: the store the gateway keeps its state in.
    """

    def __init__(self, store: RolloutStore) -> None:
        self.store = store
        #: The gateway's exit reports (made by :meth:`exit_board`).
        self.board: ExitBoard | None = None

    @abc.abstractmethod
    def exit_board(self) -> ExitBoard:
        """The board of the gateway's exit reports, numbered as this coordination
        numbers them (call once)."""

    def watch(self, events: StoreEvents) -> None:  # noqa: B027 - nothing to hear alone
        """Tell ``events`` what other gateways change, from :meth:`open` on."""

    @abc.abstractmethod
    async def open(self, contents: StoreContents) -> list[RolloutRow]:
        """Start (the store is open and held ``contents``); the stored rollouts the gateway
        holds from now on (the others load on demand: :meth:`find`)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish background writes and stop. Idempotent."""

    @abc.abstractmethod
    def vouches_for(self, revision: int) -> bool:
        """Whether a copy reflecting stored ``revision`` (``-1``: none it can vouch for) is
        the stored rollout without asking the store: its turn then needs no claim (nor
        release), and a request it refuses is refused before one."""

    @abc.abstractmethod
    async def claim(self, rollout_id: str, owner: str, lease_s: float, held: HeldCopy) -> Claim:
        """Take the rollout's turn for ``owner`` (a gateway's id): other gateways wait
        until :meth:`release` (or until ``lease_s`` runs out, when ``owner`` died). Returns
        what ``held`` missed. Raises :class:`~.store.UnknownRolloutError`."""

    @abc.abstractmethod
    async def release(self, rollout_id: str, owner: str, *, delivered: bool | None) -> None:
        """Give the turn back (nothing when ``owner`` does not hold it). ``delivered``: the
        claim handed the rollout's last answer to a client still connected (``None``: it
        answered nothing)."""

    @abc.abstractmethod
    async def catch_up(self, rollout_id: str, held: HeldCopy) -> Claim:
        """What ``held`` missed, without taking the turn (a read: a trajectory). Raises
        :class:`~.store.UnknownRolloutError`."""

    @abc.abstractmethod
    async def find(self, rollout_id: str) -> RolloutRow | None:
        """A stored rollout the gateway does not hold (registered at another gateway)."""

    @abc.abstractmethod
    async def find_key(self, key_digest: str) -> str | None:
        """The rollout of a key the gateway does not hold (registered elsewhere)."""

    @abc.abstractmethod
    async def may_delete(self, rollout_id: str, *, idle_s: float, now: float) -> bool:
        """Whether a rollout idle here for ``idle_s`` goes from the store at ``now``
        (Unix time): not when another gateway changed it since."""

    @abc.abstractmethod
    async def report_exit(self, report: ExitReport) -> None:
        """Keep an agent's report (unnumbered): numbered, merged over the rollout's last
        one, and on the board of every gateway that shares the numbering."""

    @abc.abstractmethod
    def dropped(self, rollout_id: str) -> None:
        """The gateway dropped its copy of the rollout (unregistered or expired here)."""

    async def refresh_policy(self) -> None:  # noqa: B027 - nothing to read alone
        """Read the policy version in effect where another gateway may have announced it
        (told to :meth:`watch`'s events)."""

    def _board(self) -> ExitBoard:
        if self.board is None:
            raise RuntimeError("exit_board() was not called")
        return self.board


class LocalCoordinator(TurnCoordinator):
    """A gateway alone on its store: its copies are the stored ones (a copy it can vouch
    for is never read again), its turns need no slot, its board numbers its exit reports
    and keeps them in the store in the background (a report is a hint: one lost in a
    crash costs the env a sandbox poll)."""

    def __init__(self, store: RolloutStore) -> None:
        super().__init__(store)
        self._writes: set[asyncio.Task[None]] = set()

    def exit_board(self) -> ExitBoard:
        """A board numbering its reports, journaled to the store."""
        self.board = ExitBoard(journal=self)
        return self.board

    async def open(self, contents: StoreContents) -> list[RolloutRow]:
        """Every stored rollout."""
        return contents.rollouts

    async def close(self) -> None:
        """Wait for the report writes."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def vouches_for(self, revision: int) -> bool:
        """For a copy loaded and not left stale: this gateway writes alone."""
        return revision >= 0

    async def claim(self, rollout_id: str, owner: str, lease_s: float, held: HeldCopy) -> Claim:
        """At once for a copy the gateway vouches for; else the stored rollout."""
        return await self.catch_up(rollout_id, held)

    async def release(self, rollout_id: str, owner: str, *, delivered: bool | None) -> None:
        """No slot was taken."""

    async def catch_up(self, rollout_id: str, held: HeldCopy) -> Claim:
        """At once for a copy the gateway vouches for (its writes are the only ones);
        else the stored rollout."""
        if held.revision >= 0:
            return Claim(held.revision)
        row = await self.store.load_rollout(rollout_id)
        if row is None:
            raise UnknownRolloutError(rollout_id)
        return Claim(row.revision, row)

    async def find(self, rollout_id: str) -> RolloutRow | None:
        """None: the gateway holds every stored rollout."""
        return None

    async def find_key(self, key_digest: str) -> str | None:
        """None: the gateway holds every stored rollout."""
        return None

    async def may_delete(self, rollout_id: str, *, idle_s: float, now: float) -> bool:
        """Always: nobody else uses it."""
        return True

    async def report_exit(self, report: ExitReport) -> None:
        """Numbered by the board, at once."""
        started = bool(report.get("started"))
        self._board().report(report["rollout_id"], report["exit_code"], started=started)

    def dropped(self, rollout_id: str) -> None:
        """Its report goes with it."""
        self._board().forget(rollout_id)

    # -- the board's journal (rollout_gateway.exits.ExitJournal) ---------------------------

    def exit_saved(self, report: ExitReport) -> None:
        """Keep ``report`` in the store (in the background)."""
        self._write(self.store.save_exit(dict(report)))  # type: ignore[arg-type]

    def exit_forgotten(self, rollout_id: str) -> None:
        """Drop the rollout's report from the store (in the background)."""
        self._write(self.store.forget_exit(rollout_id))

    def _write(self, write: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(_quietly(write))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)


async def _quietly(write: Coroutine[Any, Any, Any]) -> None:
    try:
        await write
    except StoreError as exc:  # a report is a hint: the env also polls its sandbox
        logger.warning("an exit report was not stored: %s", exc)


__all__ = ["Claim", "HeldCopy", "LocalCoordinator", "TurnCoordinator"]
