"""Several gateways of one process on one memory store, as gateways share Redis (tests).

:class:`SharedMemoryStore` is a :class:`~.memory.MemoryStore` whose gateways each take a
:class:`MemoryCoordinator` (:meth:`SharedMemoryStore.coordinator`): turn slots are claimed
and waited for, each gateway reads what another one changed, exit reports are numbered
once for all, and every gateway hears of reports, removals and policy announcements. The
tests of the shared path run on it (nothing survives the process).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from rollout_gateway.exits import merged_report
from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.state.backends import coordinator_for
from rollout_gateway.server.state.coordinator import Claim, HeldCopy, TurnCoordinator
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.shared import SharedCoordinator
from rollout_gateway.server.state.store import (
    PolicyState,
    RolloutStore,
    StoreContents,
    StoreEvents,
    TurnAnswer,
    TurnCommit,
    UnknownRolloutError,
)


@dataclass(slots=True)
class _Slot:
    """Who runs a rollout's turn, until when (loop time), and the waiters' event."""

    owner: str | None = None
    lease_until: float = 0.0
    released: asyncio.Event = field(default_factory=asyncio.Event)


class SharedMemoryStore(MemoryStore):
    """One memory store for several gateways of this process (see the module doc): the
    last answer stays undelivered until the gateway that answered says otherwise, a
    commit may end its claim, and every gateway hears of a removal or an announcement."""

    def __init__(self) -> None:
        super().__init__()
        #: Each gateway's events (its coordinator's).
        self.watchers: list[StoreEvents] = []
        self.slots: dict[str, _Slot] = {}

    def coordinator(self) -> MemoryCoordinator:
        """One gateway's coordination on this store."""
        return MemoryCoordinator(self)

    async def open(self) -> StoreContents:
        """What this store holds now (its gateways load rollouts on demand)."""
        contents = await super().open()
        contents.rollouts = []
        return contents

    async def commit_turn(self, rollout_id: str, commit: TurnCommit) -> int:
        """As one gateway's store, the answer undelivered until its gateway says so; the
        claim ``commit.releases`` names ends with it."""
        answer = commit.answer
        if answer is not None:
            key = replace(answer.key, delivered=False)
            commit = replace(commit, answer=TurnAnswer(key, answer.body))
        revision = await super().commit_turn(rollout_id, commit)
        if commit.releases is not None:
            self.release(rollout_id, commit.releases, commit.delivered)
        return revision

    async def delete_rollout(self, rollout_id: str) -> bool:
        """Drop it; waiting claims find it gone and every gateway hears of it."""
        existed = await super().delete_rollout(rollout_id)
        slot = self.slots.pop(rollout_id, None)
        if slot is not None:
            slot.released.set()
        if existed:
            for watcher in self.watchers:
                watcher.rollout_removed(rollout_id)
        return existed

    async def announce_policy(self, version: int, at: float) -> PolicyState:
        """Forward only; every gateway hears of a new version."""
        before = self._policy.version
        state = await super().announce_policy(version, at)
        if state.version != before:
            for watcher in self.watchers:
                watcher.policy_announced(PolicyState(state.version, state.updated_at))
        return state

    def release(self, rollout_id: str, owner: str, delivered: bool | None) -> None:
        """Free the rollout's slot if ``owner`` holds it, noting a delivered answer."""
        slot = self.slots.get(rollout_id)
        rollout = self._rollouts.get(rollout_id)
        if slot is None or slot.owner != owner:
            return
        answer = rollout.answer if rollout is not None else None
        if delivered and answer is not None and not answer.key.delivered:
            key = replace(answer.key, delivered=True)
            rollout.answer = TurnAnswer(key, answer.body, answer.without_prompt_ids)  # type: ignore[union-attr]
        slot.owner = None
        slot.released.set()
        slot.released = asyncio.Event()


class MemoryCoordinator(SharedCoordinator):
    """One gateway's coordination on a :class:`SharedMemoryStore`."""

    store: SharedMemoryStore

    def __init__(self, store: SharedMemoryStore) -> None:
        super().__init__(store)

    def watch(self, events: StoreEvents) -> None:
        """Tell ``events`` what other gateways change."""
        super().watch(events)
        self.store.watchers.append(events)

    async def close(self) -> None:
        """Stop hearing of the other gateways."""
        await super().close()
        if self.events is not None and self.events in self.store.watchers:
            self.store.watchers.remove(self.events)

    async def claim(self, rollout_id: str, owner: str, lease_s: float, held: HeldCopy) -> Claim:
        """The slot once free (or its holder's lease run out), and what ``held`` missed:
        the stored rollout and its steps since the copy's, read along."""
        loop = asyncio.get_running_loop()
        slot = self.store.slots.setdefault(rollout_id, _Slot())
        while slot.owner not in (None, owner) and loop.time() < slot.lease_until:
            try:
                async with asyncio.timeout(slot.lease_until - loop.time()):
                    await slot.released.wait()
            except TimeoutError:
                pass  # the owner's lease ran out: take the slot over
            slot = self.store.slots.setdefault(rollout_id, _Slot())
        row = await self.store.load_rollout(rollout_id)
        if row is None:
            raise UnknownRolloutError(rollout_id)
        slot.owner, slot.lease_until = owner, loop.time() + lease_s
        if row.revision == held.revision and row.steps == held.steps:
            return Claim(row.revision)
        steps = []
        if row.steps > held.steps:
            steps = await self.store.load_steps(rollout_id, held.steps)
        return Claim(row.revision, row, steps)

    async def release(self, rollout_id: str, owner: str, *, delivered: bool | None) -> None:
        """Free the slot if ``owner`` holds it."""
        self.store.release(rollout_id, owner, delivered)

    async def number_exit(self, report: ExitReport) -> ExitReport | None:
        """Merged over the stored report, numbered once for every gateway; each hears."""
        store = self.store
        rollout_id = report["rollout_id"]
        if await store.load_rollout(rollout_id) is None:
            raise UnknownRolloutError(rollout_id)
        kept = merged_report(store._exits.get(rollout_id), report)
        if kept is None:
            return None
        store._exit_seq += 1
        numbered: ExitReport = {**kept, "seq": store._exit_seq}
        store._exits[rollout_id] = numbered
        for watcher in store.watchers:
            watcher.exit_reported(dict(numbered))  # type: ignore[arg-type]
        return numbered


__all__ = ["MemoryCoordinator", "SharedMemoryStore"]


def coordination(store: RolloutStore) -> TurnCoordinator:
    """A gateway's coordination on ``store``: its own for a :class:`SharedMemoryStore`
    (which the package does not know), else what the app would choose
    (:func:`~rollout_gateway.server.state.backends.coordinator_for`)."""
    if isinstance(store, SharedMemoryStore):
        return store.coordinator()
    return coordinator_for(store)
