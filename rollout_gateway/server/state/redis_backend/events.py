"""What one gateway hears of the others on Redis: :class:`EventListener`.

Each gateway subscribes to the events channel (one connection of its own; messages in
:mod:`.scripts`): a released lease wakes the claims of this gateway waiting for it
(:meth:`EventListener.waker`), a removed rollout and a policy announcement are passed on
to the gateway (:class:`~rollout_gateway.server.state.store.StoreEvents`), and an exit
report makes it read the reports added to the stream since the last one it read, in
number order. After a lost connection it subscribes again, reads the policy version and
the exit stream afresh and has the gateway drop its copies of rollouts no longer stored
(:meth:`~rollout_gateway.server.state.store.StoreEvents.missed_events`): nothing
published meanwhile is missed (a wake-up is: a waiting claim looks again every
:data:`RECHECK_S` anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.state.redis_backend.connection import RedisConnection
from rollout_gateway.server.state.store import PolicyState, StoreEvents

logger = logging.getLogger("rollout_gateway.server")

#: A claim waiting for another gateway's turn looks again at least this often (a message
#: wakes it sooner: this bounds what a lost message costs).
RECHECK_S = 0.25
#: The listener looks whether it is asked to stop at least this often.
POLL_S = 1.0


class EventListener:
    """The events channel, heard for one gateway.

    Args:
        connection: where Redis is.
        channel: the events channel's name.
        load_policy: reads the policy version in effect.
        exits_after: reads the exit reports numbered above a cursor.
    """

    def __init__(
        self,
        connection: RedisConnection,
        channel: str,
        *,
        load_policy: Callable[[], Awaitable[PolicyState]],
        exits_after: Callable[[int], Awaitable[list[ExitReport]]],
    ) -> None:
        self.connection = connection
        self.channel = channel
        self._load_policy = load_policy
        self._exits_after = exits_after
        #: Told what other gateways change (``None``: nobody listens).
        self.events: StoreEvents | None = None
        self._wakers: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        #: The newest policy version passed on.
        self._policy_version: int | None = None
        #: The number of the last exit report passed on.
        self.exits_read = 0

    def waker(self, rollout_id: str) -> asyncio.Event:
        """Set when the rollout's lease is released (made before asking for the lease:
        a release between the answer and the wait still wakes it)."""
        return self._wakers.setdefault(rollout_id, asyncio.Event())

    def done_waiting(self, rollout_id: str, waker: asyncio.Event) -> None:
        """The claim got the lease: its waker is no longer needed."""
        if self._wakers.get(rollout_id) is waker and not waker.is_set():
            del self._wakers[rollout_id]

    def start(self, exits_read: int) -> None:
        """Listen (in a task of the running loop), passing on reports after ``exits_read``
        (once: a listener started already goes on)."""
        if self._task is not None:
            return
        self.exits_read = exits_read
        if self.events is not None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._listen(), name="redis-events")

    async def stop(self) -> None:
        """Stop listening. (Asked to stop and cancelled: a cancellation redis-py's read
        swallows, which happens, still ends the listener at its next look at the flag.)"""
        task, self._task = self._task, None
        self._wakers.clear()
        if task is not None:
            self._stopping = True
            task.cancel()
            await asyncio.wait([task], timeout=2 * POLL_S)

    def policy_seen(self, state: PolicyState) -> None:
        """Pass on a policy version newer than the last one passed on."""
        if state.version is None or self.events is None:
            return
        if self._policy_version is None or state.version > self._policy_version:
            self._policy_version = state.version
            self.events.policy_announced(state)

    async def _listen(self) -> None:
        # No reply timeout: the channel may be quiet for hours; health checks find a dead
        # connection instead.
        timeout = self.connection.timeout_s
        client = self.connection.new_client(socket_timeout=None, health_check_interval=timeout)
        try:
            while not self._stopping:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(self.channel)
                    self.policy_seen(await self._load_policy())  # (published while away)
                    await self._read_exits()
                    if self.events is not None:  # removals published while away
                        await self.events.missed_events()
                    while not self._stopping:
                        message = await pubsub.get_message(timeout=POLL_S)
                        if message is not None and message.get("type") == "message":
                            await self._heard(message.get("data") or b"")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning("redis events lost (%s); reconnecting", exc)
                finally:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
                await asyncio.sleep(RECHECK_S)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _heard(self, data: bytes) -> None:
        kind, _, rollout_id = data.decode().partition(":")
        waker = self._wakers.pop(rollout_id, None) if rollout_id else None
        if waker is not None:
            waker.set()
        if self.events is None:
            return
        if kind == "d":
            self.events.rollout_removed(rollout_id)
        elif kind == "e":
            await self._read_exits()
        elif kind == "p":
            self.policy_seen(await self._load_policy())

    async def _read_exits(self) -> None:
        for report in await self._exits_after(self.exits_read):
            self.exits_read = max(self.exits_read, report["seq"])
            if self.events is not None:
                self.events.exit_reported(report)


__all__ = ["POLL_S", "RECHECK_S", "EventListener"]
