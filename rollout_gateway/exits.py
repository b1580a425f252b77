"""Agent exit reports: noticing an agent's exit in milliseconds without polling sandboxes.

An agent's launch wrapper posts its exit code to ``POST /v1/rollouts/{id}/exit`` (through
the tunnel, with the rollout's key) the moment it exits. The gateway keeps the reports
on an :class:`ExitBoard`; each env runs one :class:`ExitWatcher` per gateway that
follows the gateway's exit stream (``GET /v1/rollouts/exits?after=<seq>&stream=1``, one
held connection, a line per report) for all its rollouts and wakes the one whose agent
exited. A gateway without the stream is long-polled
(``GET /v1/rollouts/exits?after=<seq>&timeout=<s>``). A report is a hint (the agent
holds the key it is sent with): the rollout confirms it with one sandbox status call. A
gateway without the extension (404/405) turns the watcher off, and rollouts poll as
before.

The same channel carries two more reports about a rollout: the wrapper's ``started``
(it runs and can report the exit: a rollout that never hears it polls its sandbox
instead of waiting for a report that cannot come) and the gateway's own ``refused``
(it refused a turn of the rollout: a limit was reached, the rollout was cancelled...;
the env stops the agent at once, whatever the agent does with the refusal). A
refusal is the gateway's word, not the agent's, and no later report of the agent
erases it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any, Protocol, cast

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient
from rollout_gateway.errors import GatewayAuthError, GatewayError, GatewayRequestError
from rollout_gateway.protocol import ExitReport, ExitsResponse, exit_stream_line

logger = logging.getLogger(__name__)

#: Reports kept for rollouts that were not (yet) waiting when they arrived.
UNCLAIMED_LIMIT = 10_000

#: After an answer with reports, wait this long before asking again, so the exits of a
#: burst come back a few per call rather than one call each (10 ms is far below the
#: detection target of 50 ms, and cuts the polls of a 500-rollout burst several-fold).
EXIT_COALESCE = 0.01

#: A rollout's exit reports wake the board's followers (every env's exit stream) at most
#: once per this many seconds; a repeat within it is stored at once and delivered with the
#: next wake, at the latest when the interval ends. The agent holds the key a report is
#: made with: without this bound one agent posting reports in a loop would make every
#: env's stream carry, and every env parse, a line per post.
REPORT_WAKE_INTERVAL = 1.0

#: The pause before reopening an exit stream that worked and then ended or broke (a
#: gateway that drops every stream at once must not make the watcher spin).
STREAM_REOPEN_PAUSE = 0.05


class ExitJournal(Protocol):
    """Where a board's reports are kept beyond the process (the gateway's state store)."""

    def exit_saved(self, report: ExitReport) -> None:
        """``report`` (numbered) is its rollout's report now."""
        ...

    def exit_forgotten(self, rollout_id: str) -> None:
        """The rollout's report was dropped."""
        ...


class ExitBoard:
    """Exit reports of registered rollouts, numbered, with waiters for new ones.

    Waiting costs no task: a waiter awaits the board's event under
    :func:`asyncio.timeout` (a timer), so hundreds of long-polls hold no helper tasks.
    ``journal`` (optional) is told of every report and every dropped one; a restarted
    board is filled again with :meth:`restore`.
    """

    def __init__(
        self,
        *,
        wake_interval: float = REPORT_WAKE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        journal: ExitJournal | None = None,
    ) -> None:
        # In ``seq`` order (a replaced report moves to the end): the newest are last.
        self._reports: dict[str, ExitReport] = {}
        self._seq = 0
        self._changed = asyncio.Event()
        #: Long-polls and streams waiting for a report now.
        self.waiting = 0
        self.wake_interval = wake_interval
        self._clock = clock
        self._last_wake: dict[str, float] = {}  # per rollout (see REPORT_WAKE_INTERVAL)
        self._deferred_wake: asyncio.TimerHandle | None = None
        self._journal = journal

    def restore(self, reports: Iterable[ExitReport], cursor: int) -> None:
        """Hold ``reports`` (oldest first) again, numbering on from ``cursor`` (a restart:
        an env's cursor from before it stays valid)."""
        for report in sorted(reports, key=lambda r: r["seq"]):
            self._reports.pop(report["rollout_id"], None)
            self._reports[report["rollout_id"]] = report
        self._seq = max(self._seq, cursor, *(r["seq"] for r in self._reports.values()))

    def apply(self, report: ExitReport) -> None:
        """Hold ``report``, numbered elsewhere (another gateway on a shared store), and
        wake the waiters; the cursor goes on from its number."""
        self._reports.pop(report["rollout_id"], None)
        self._reports[report["rollout_id"]] = report
        self._seq = max(self._seq, report["seq"])
        self.wake()

    @property
    def cursor(self) -> int:
        """The number of the latest report."""
        return self._seq

    def report(self, rollout_id: str, exit_code: int | None, *, started: bool = False) -> None:
        """Record (or replace) the agent's report about ``rollout_id`` (its exit, or with
        ``started`` that its launch wrapper runs) and wake the waiters (a repeat within
        :data:`REPORT_WAKE_INTERVAL` wakes them when it ends). A refusal the gateway
        reported stays on the rollout's report (see :meth:`refused`)."""
        previous = self._reports.get(rollout_id)
        if started and previous is not None:
            return  # sent beside the agent: it may come after the agent's exit report
        report: ExitReport = {"rollout_id": rollout_id, "exit_code": exit_code, "seq": 0}
        if started:
            report["started"] = True
        if previous is not None and "refused" in previous:
            report["refused"] = previous["refused"]  # the agent cannot erase it
        self._post(report, urgent=False)

    def refused(self, rollout_id: str, code: str) -> None:
        """The gateway refused a turn of ``rollout_id`` (``code`` says why): report it at
        once, whatever the agent reported just before (the env stops the agent on it).
        Only the first refusal of a rollout is reported."""
        previous = self._reports.get(rollout_id)
        if previous is not None and "refused" in previous:
            return
        report: ExitReport = {
            "rollout_id": rollout_id,
            "exit_code": previous["exit_code"] if previous is not None else None,
            "seq": 0,
            "refused": code,
        }
        self._post(report, urgent=True)

    def _post(self, report: ExitReport, *, urgent: bool) -> None:
        rollout_id = report["rollout_id"]
        self._seq += 1
        report["seq"] = self._seq
        self._reports.pop(rollout_id, None)
        self._reports[rollout_id] = report
        if self._journal is not None:
            self._journal.exit_saved(report)
        now = self._clock()
        last = self._last_wake.get(rollout_id)
        if urgent or last is None or now - last >= self.wake_interval:
            self._last_wake[rollout_id] = now
            self.wake()
        elif self._deferred_wake is None:
            delay = last + self.wake_interval - now
            self._deferred_wake = asyncio.get_running_loop().call_later(delay, self._wake_late)

    def _wake_late(self) -> None:
        self._deferred_wake = None
        self.wake()

    def wake(self) -> None:
        """Wake every waiter (a report came, or the gateway is shutting down)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def forget(self, rollout_id: str) -> None:
        """Drop the report of an unregistered rollout (the board holds only live ones)."""
        if self._reports.pop(rollout_id, None) is not None and self._journal is not None:
            self._journal.exit_forgotten(rollout_id)
        self._last_wake.pop(rollout_id, None)

    def resume_point(self, after: int) -> int:
        """``after``, or 0 for a cursor from before a gateway restart (beyond ours)."""
        return 0 if after > self._seq else after

    def after(self, after: int) -> list[ExitReport]:
        """Reports numbered above ``after``, oldest first (in time of the new ones only)."""
        newer: list[ExitReport] = []
        for report in reversed(self._reports.values()):
            if report["seq"] <= after:
                break
            newer.append(report)
        newer.reverse()
        return newer

    def since(self, after: int) -> ExitsResponse:
        """Reports numbered above ``after``, oldest first, and the cursor to ask from next.

        A cursor beyond ours comes from before a gateway restart: everything is new to it.
        """
        return {"exits": self.after(self.resume_point(after)), "cursor": self._seq}

    async def changed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the next report (or :meth:`wake`); whether it came."""
        event = self._changed
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
        return True

    async def wait(self, after: int, timeout: float) -> ExitsResponse:
        """Like :meth:`since`, waiting up to ``timeout`` s for a report when there is none."""
        answer = self.since(after)
        if answer["exits"] or timeout <= 0:
            return answer
        await self.changed(timeout)
        return self.since(after)

    async def follow(
        self,
        after: int,
        *,
        keepalive: float = protocol.EXIT_STREAM_KEEPALIVE,
        closed: Callable[[], bool] = lambda: False,
    ) -> AsyncGenerator[bytes, None]:
        """The exit stream from cursor ``after``, as chunks of encoded lines.

        First the reports above ``after`` and a heartbeat with the cursor, then each
        report as it comes (those that came together in one chunk), and a heartbeat
        after ``keepalive`` s without one. Ends when ``closed()`` is true after a wake.
        The reference gateway and :class:`~rollout_gateway.testing.FakeGateway` both
        serve this.
        """
        cursor = self.resume_point(after)
        reports = self.after(cursor)
        cursor = self._seq
        yield b"".join(map(exit_stream_line, reports)) + exit_stream_line({"cursor": cursor})
        while not closed():
            reports = self.after(cursor)
            cursor = self._seq
            if reports:
                yield b"".join(map(exit_stream_line, reports))
            elif not await self.changed(keepalive):
                yield exit_stream_line({"cursor": cursor})


class ExitWatcher:
    """One exit stream per gateway, shared by the env's rollouts.

    It follows the gateway's exit stream (:meth:`GatewayClient.exit_feed`, one held
    connection) and wakes each rollout the moment its report arrives. A broken or silent
    stream is reopened from the last cursor seen, with backoff. A gateway without the
    stream (it answers the plain long-poll, or 400/404/405) is long-polled instead; one
    refusing a stream now (429: its cap of streams is reached) is long-polled once
    before the stream is tried again; one without exit reports at all (404/405 to the
    long-poll) turns the watcher off, and rollouts poll their sandboxes.

    Args:
        client: the gateway's control-plane client.
        wait: seconds one long-poll may wait (at most :data:`protocol.EXITS_MAX_WAIT`).
        coalesce: seconds to wait after a long-poll answer with reports before the next.
        sleep: the pause of backoff and coalescing (a seam for tests).
        stream: whether to try the stream (else long-poll only).
    """

    def __init__(
        self,
        client: GatewayClient,
        *,
        wait: float = protocol.EXITS_MAX_WAIT,
        coalesce: float = EXIT_COALESCE,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        stream: bool = True,
    ) -> None:
        self.client = client
        self.wait = min(wait, protocol.EXITS_MAX_WAIT)
        self.coalesce = coalesce
        self._sleep = sleep
        #: ``None`` until the gateway answered once; then whether it has exit reports.
        self.supported: bool | None = None
        #: ``None`` until known; whether the gateway serves the exit stream.
        self.streaming: bool | None = None if stream else False
        # Per rollout: the future and whether it takes the whole report (else its code).
        self._waiters: dict[str, tuple[asyncio.Future[Any], bool]] = {}
        self._unclaimed: OrderedDict[str, ExitReport] = OrderedDict()
        self._cursor = 0
        self._poll_instead = False  # the stream was refused: one long-poll first
        self._lines = 0  # lines of the current stream
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def cursor(self) -> int:
        """The last report number seen (the stream resumes after it)."""
        return self._cursor

    def subscribe(self, rollout_id: str) -> asyncio.Future[int | None]:
        """A future resolved with the exit code of the next report about ``rollout_id``."""
        return self._subscribe(rollout_id, whole=False)

    def subscribe_report(self, rollout_id: str) -> asyncio.Future[ExitReport]:
        """A future resolved with the next report about ``rollout_id`` itself (its exit,
        its wrapper's start, or the gateway's refusal of a turn). One waiter per rollout:
        a new subscription replaces the previous one."""
        return self._subscribe(rollout_id, whole=True)

    def _subscribe(self, rollout_id: str, *, whole: bool) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if rollout_id in self._unclaimed:
            report = self._unclaimed.pop(rollout_id)
            future.set_result(report if whole else report["exit_code"])
            return future
        self._waiters[rollout_id] = (future, whole)
        if (
            not self._closed
            and self.supported is not False
            and (self._task is None or self._task.done())
        ):
            self._task = asyncio.ensure_future(self._loop())
        return future

    def unsubscribe(self, rollout_id: str) -> None:
        """Stop waiting for ``rollout_id`` (its wait ended another way)."""
        waiter = self._waiters.pop(rollout_id, None)
        if waiter is not None and not waiter[0].done():
            waiter[0].cancel()
        if not self._waiters and self._task is not None:
            self._task.cancel()  # nobody waits: no stream or long-poll held open
            self._task = None

    async def aclose(self) -> None:
        """Stop the loop (closing its stream) and release every waiter. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        waiters, self._waiters = self._waiters, {}
        for future, _ in waiters.values():
            if not future.done() and future.get_loop() is asyncio.get_running_loop():
                future.cancel()

    async def _loop(self) -> None:
        failures = 0
        while self._waiters and not self._closed:
            self._lines = 0
            try:
                if self.streaming is False or self._poll_instead:
                    self._poll_instead = False
                    if not await self._poll():
                        return
                    failures = 0
                    continue
                await self._follow()
            except GatewayAuthError:
                # The token was refused (the client logged it): no reports will come;
                # rollouts poll their sandboxes.
                self.supported = False
                return
            except GatewayRequestError as e:
                if e.status_code in (400, 404, 405) and self.streaming is not False:
                    logger.info("gateway %s has no exit stream: long-polling", self.client.base_url)
                    self.streaming = False
                    continue
                logger.warning("exit reports failed (%d in a row): %s", failures + 1, e)
            except GatewayError as e:
                if e.status_code == 429 and self.streaming is not False:
                    self._poll_instead = True  # the gateway's cap of streams: poll once
                    continue
                if not self._lines:
                    logger.warning("exit reports failed (%d in a row): %s", failures + 1, e)
            if self._lines:  # the stream worked, then ended or broke: reopen it at once
                failures = 0
                await self._sleep(STREAM_REOPEN_PAUSE)
                continue
            failures += 1
            await self._sleep(min(30.0, 0.5 * 2**failures))

    async def _follow(self) -> None:
        """Follow the stream from the cursor until it ends (``_lines`` counts its lines)."""
        async with self.client.exit_feed(self._cursor) as feed:
            self.supported = True
            # A gateway without the stream answered the long-poll: take it, then poll.
            self.streaming = feed.streamed
            async for line in feed:
                self._lines += 1
                self._take(line)

    async def _poll(self) -> bool:
        """One long-poll; false when the gateway has no exit reports at all."""
        # The first call answers at once, so support is known before anyone waits long.
        timeout = self.wait if self.supported else 0.0
        try:
            answer = await self.client.wait_exits(self._cursor, timeout)
        except GatewayRequestError as e:
            if e.status_code in (404, 405):
                logger.info("gateway %s has no exit reports: polling", self.client.base_url)
                self.supported = False
                return False
            raise
        self.supported = True
        for report in answer["exits"]:
            self._take(report)
        self._cursor = answer["cursor"]
        if answer["exits"] and self.coalesce > 0:
            await self._sleep(self.coalesce)
        return True

    def _take(self, line: protocol.ExitStreamLine) -> None:
        """Advance the cursor over ``line``; deliver it if it is a report."""
        if "rollout_id" not in line:
            self._cursor = line["cursor"]  # may go down: the gateway restarted
            return
        report = cast(ExitReport, line)
        self._cursor = report["seq"]
        waiter = self._waiters.pop(report["rollout_id"], None)
        if waiter is not None:
            future, whole = waiter
            if not future.done():
                future.set_result(report if whole else report["exit_code"])
            return
        self._unclaimed.pop(report["rollout_id"], None)
        self._unclaimed[report["rollout_id"]] = report
        while len(self._unclaimed) > UNCLAIMED_LIMIT:
            self._unclaimed.popitem(last=False)


__all__ = [
    "EXIT_COALESCE",
    "STREAM_REOPEN_PAUSE",
    "UNCLAIMED_LIMIT",
    "ExitBoard",
    "ExitJournal",
    "ExitWatcher",
]
