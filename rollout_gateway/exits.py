"""Agent exit reports: noticing an agent's exit in milliseconds without polling sandboxes.

An agent's launch wrapper posts its exit code to ``POST /v1/rollouts/{id}/exit`` (through
the tunnel, with the rollout's key) the moment it exits. The gateway keeps the reports
on an :class:`ExitBoard`; each env runs one :class:`ExitWatcher` per gateway that
long-polls ``GET /v1/rollouts/exits?after=<seq>&timeout=<s>`` for all its rollouts and
wakes the one whose agent exited. A report is a hint (the agent holds the key it is sent
with): the rollout confirms it with one sandbox status call. A gateway without the
extension (404/405) turns the watcher off, and rollouts poll as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient
from rollout_gateway.errors import GatewayError, GatewayRequestError
from rollout_gateway.protocol import ExitReport, ExitsResponse

logger = logging.getLogger(__name__)

#: Reports kept for rollouts that were not (yet) waiting when they arrived.
UNCLAIMED_LIMIT = 10_000

#: After an answer with reports, wait this long before asking again, so the exits of a
#: burst come back a few per call rather than one call each (10 ms is far below the
#: detection target of 50 ms, and cuts the polls of a 500-rollout burst several-fold).
EXIT_COALESCE = 0.01


class ExitBoard:
    """Exit reports of registered rollouts, numbered, with waiters for new ones."""

    def __init__(self) -> None:
        self._reports: dict[str, ExitReport] = {}
        self._seq = 0
        self._changed = asyncio.Event()

    def report(self, rollout_id: str, exit_code: int | None) -> None:
        """Record (or replace) the exit report of ``rollout_id`` and wake the waiters."""
        self._seq += 1
        self._reports[rollout_id] = {
            "rollout_id": rollout_id,
            "exit_code": exit_code,
            "seq": self._seq,
        }
        self._changed.set()
        self._changed = asyncio.Event()

    def forget(self, rollout_id: str) -> None:
        """Drop the report of an unregistered rollout (the board holds only live ones)."""
        self._reports.pop(rollout_id, None)

    def since(self, after: int) -> ExitsResponse:
        """Reports numbered above ``after``, oldest first, and the cursor to ask from next.

        A cursor beyond ours comes from before a gateway restart: everything is new to it.
        """
        if after > self._seq:
            after = 0
        exits = sorted(
            (r for r in self._reports.values() if r["seq"] > after), key=lambda r: r["seq"]
        )
        return {"exits": exits, "cursor": self._seq}

    async def wait(self, after: int, timeout: float) -> ExitsResponse:
        """Like :meth:`since`, waiting up to ``timeout`` s for a report when there is none."""
        answer = self.since(after)
        if answer["exits"] or timeout <= 0:
            return answer
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            pass
        return self.since(after)


class ExitWatcher:
    """One long-poll loop over a gateway's exit reports, shared by the env's rollouts.

    Args:
        client: the gateway's control-plane client.
        wait: seconds one long-poll may wait (at most :data:`protocol.EXITS_MAX_WAIT`).
        coalesce: seconds to wait after an answer with reports before the next poll.
        sleep: the pause after a failed poll or an answer (a seam for tests).
    """

    def __init__(
        self,
        client: GatewayClient,
        *,
        wait: float = protocol.EXITS_MAX_WAIT,
        coalesce: float = EXIT_COALESCE,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.wait = min(wait, protocol.EXITS_MAX_WAIT)
        self.coalesce = coalesce
        self._sleep = sleep
        #: ``None`` until the gateway answered once; then whether it has the extension.
        self.supported: bool | None = None
        self._waiters: dict[str, asyncio.Future[int | None]] = {}
        self._unclaimed: OrderedDict[str, int | None] = OrderedDict()
        self._cursor = 0
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def subscribe(self, rollout_id: str) -> asyncio.Future[int | None]:
        """A future resolved with the exit code the agent of ``rollout_id`` reports."""
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        if rollout_id in self._unclaimed:
            future.set_result(self._unclaimed.pop(rollout_id))
            return future
        self._waiters[rollout_id] = future
        if (
            not self._closed
            and self.supported is not False
            and (self._task is None or self._task.done())
        ):
            self._task = asyncio.ensure_future(self._loop())
        return future

    def unsubscribe(self, rollout_id: str) -> None:
        """Stop waiting for ``rollout_id`` (its wait ended another way)."""
        future = self._waiters.pop(rollout_id, None)
        if future is not None and not future.done():
            future.cancel()
        if not self._waiters and self._task is not None:
            self._task.cancel()  # nobody waits: no long-poll held open
            self._task = None

    async def aclose(self) -> None:
        """Stop the loop and release every waiter. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        waiters, self._waiters = self._waiters, {}
        for future in waiters.values():
            if not future.done() and future.get_loop() is asyncio.get_running_loop():
                future.cancel()

    async def _loop(self) -> None:
        failures = 0
        while self._waiters and not self._closed:
            # The first call answers at once, so support is known before anyone waits long.
            timeout = self.wait if self.supported else 0.0
            try:
                answer = await self.client.wait_exits(self._cursor, timeout)
            except GatewayRequestError as e:
                if e.status_code in (404, 405):
                    logger.info("gateway %s has no exit reports: polling", self.client.base_url)
                    self.supported = False
                    return
                failures += 1
            except GatewayError as e:
                failures += 1
                logger.warning("exit-report poll failed (%d in a row): %s", failures, e)
            else:
                failures = 0
                self.supported = True
                self._cursor = answer["cursor"]
                for report in answer["exits"]:
                    self._deliver(report["rollout_id"], report["exit_code"])
                if answer["exits"] and self.coalesce > 0:
                    await self._sleep(self.coalesce)
                continue
            await self._sleep(min(30.0, 0.5 * 2**failures))

    def _deliver(self, rollout_id: str, exit_code: int | None) -> None:
        future = self._waiters.pop(rollout_id, None)
        if future is not None:
            if not future.done():
                future.set_result(exit_code)
            return
        self._unclaimed[rollout_id] = exit_code
        while len(self._unclaimed) > UNCLAIMED_LIMIT:
            self._unclaimed.popitem(last=False)


__all__ = ["EXIT_COALESCE", "UNCLAIMED_LIMIT", "ExitBoard", "ExitWatcher"]
