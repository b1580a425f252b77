"""Waiting for a rollout's agent: exit reports, sandbox polling, refusals, timeout, tunnel death.

The waiting half of :class:`rollout_gateway.lifecycle.GatewayRollout` (whose
``poll_until_exit`` and ``wait_for_agent`` call these). Hundreds of rollouts wait at
once during a burst, so a wait holds no helper task: the agent timeout, the tunnel's
death and the exit channel end it in the rollout's own task
(:class:`rollout_gateway.interrupt.Interrupt`, :func:`asyncio.timeout`).

What the exit channel (:mod:`rollout_gateway.exits`) says about the rollout decides how
often its sandbox is asked:

- the launch wrapper's ``started`` report came: the agent's exit will be reported, so
  the sandbox is asked only every ``safety_interval`` s (and once to confirm a report);
- the agent was not launched behind the reporting wrapper (an env's own ``start_agent``),
  the gateway has no exit reports, no ``started`` came within ``start_grace`` s (an image
  without curl, wget or python3), or a report the sandbox did not confirm: no exit
  report can be relied on, and the sandbox is polled adaptively (see :class:`PollPolicy`);
- the gateway ``refused`` a turn: the rollout is over; the adapter's ``on_refusal``
  stops the agent at once, then the sandbox confirms its exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rollout_gateway.errors import AgentPollError, GatewayTunnelError
from rollout_gateway.interrupt import Interrupt
from rollout_gateway.protocol import ExitReport

if TYPE_CHECKING:
    from rollout_gateway.exits import ExitWatcher
    from rollout_gateway.lifecycle import AgentExit, GatewayRollout

logger = logging.getLogger(__name__)


class _Channel:
    """One rollout's subscription to its gateway's exit channel (reports one at a time)."""

    def __init__(self, watcher: ExitWatcher, rollout_id: str) -> None:
        self.watcher = watcher
        self.rollout_id = rollout_id
        self._next: asyncio.Future[ExitReport] | None = watcher.subscribe_report(rollout_id)

    @property
    def supported(self) -> bool | None:
        """Whether the gateway has exit reports (``None`` until it answered once)."""
        return self.watcher.supported

    async def wait(self, rollout: GatewayRollout, seconds: float) -> ExitReport | None:
        """Sleep ``seconds`` (the settings' sleep), or less if a report comes first."""
        future = self._next
        if future is None or not future.done():
            await _sleep_or(rollout, seconds, future)
        if future is None or not future.done() or future.cancelled():
            return None
        self._next = self.watcher.subscribe_report(self.rollout_id)
        return future.result()

    def close(self) -> None:
        self.watcher.unsubscribe(self.rollout_id)


async def poll_until_exit(
    rollout: GatewayRollout,
    probe: Callable[[], Awaitable[AgentExit | None]],
    *,
    is_transient: Callable[[BaseException], bool] = lambda e: False,
    on_refusal: Callable[[], Awaitable[Any]] | None = None,
) -> AgentExit:
    """Call ``probe`` (``None`` while the agent runs) until the agent exited.

    How often depends on the exit channel (see the module doc). ``on_refusal`` stops the
    agent when the gateway reports that it refused a turn (``record.refused`` then holds
    the refusal's code). Transient probe errors are tolerated up to the policy's limit
    in a row.
    """
    policy = rollout.settings.poll
    clock = rollout.settings.clock
    record = rollout.record
    started = clock()
    read_errors = 0
    channel: _Channel | None = None
    if rollout.settings.exit_reports and record.gateway_url is not None:
        channel = _Channel(rollout.resources.exit_watcher(record.gateway_url), record.rollout_id)
    # An exit report can come: the agent runs behind the reporting wrapper (the adapter
    # says so) and the gateway has reports. Until its start is heard, only for a while.
    expect = channel is not None and record.agent_reports
    heard_start = False

    def next_wait() -> float:
        elapsed = clock() - started
        if expect and channel is not None and channel.supported is not False:
            if heard_start and channel.supported:
                return policy.safety_interval
            if not heard_start and elapsed < policy.start_grace:
                return max(policy.min_interval, policy.start_grace - elapsed)
        return policy.interval(elapsed)

    # The first wait is short either way: a quick agent's exit report, or the gateway's
    # first answer (whether it has reports at all), usually comes within it.
    wait = policy.min_interval if channel is not None else policy.interval(0.0)
    try:
        while True:
            report: ExitReport | None = None
            if channel is not None:
                report = await channel.wait(rollout, wait)
            else:
                await rollout.settings.sleep(wait)
            if report is not None and report.get("refused") and record.refused is None:
                record.refused = report["refused"]
                expect = False
                logger.info(
                    "rollout=%s the gateway refused a turn (%s): stopping the agent",
                    record.rollout_id,
                    record.refused,
                )
                if on_refusal is not None:
                    try:
                        await on_refusal()
                    except Exception as e:  # the probe below still tells whether it ended
                        logger.warning(
                            "rollout=%s stopping the agent failed: %s", record.rollout_id, e
                        )
            elif report is not None and (report.get("started") or report["exit_code"] is None):
                # A start report (a gateway that predates "started" passes the wrapper's
                # start on as an exit code of null, which no exit report of it carries).
                heard_start = True
                wait = next_wait()
                continue
            elif report is None and expect and not heard_start:
                elapsed = clock() - started
                if elapsed < policy.start_grace and (
                    channel is None or channel.supported is not False
                ):
                    wait = next_wait()  # still waiting for the wrapper's start report
                    continue
            record.agent_polls += 1
            try:
                result = await probe()
            except Exception as e:
                if not is_transient(e):
                    raise AgentPollError(f"polling the agent failed: {e}") from e
                read_errors += 1
                if read_errors >= policy.max_consecutive_read_errors:
                    raise AgentPollError(
                        f"polling the agent failed {read_errors} times in a row: {e}"
                    ) from e
                logger.warning("rollout=%s transient poll error: %s", rollout.rollout_id, e)
            else:
                read_errors = 0
                if result is not None:
                    record.agent_exit = result
                    return result
            if report is not None and not report.get("refused"):
                expect = False  # a report the sandbox did not confirm: poll from now on
            wait = next_wait()
    finally:
        if channel is not None:
            channel.close()


async def _sleep_or(
    rollout: GatewayRollout, seconds: float, future: asyncio.Future[Any] | None
) -> None:
    """Sleep ``seconds`` (the settings' sleep), or less if ``future`` resolves first."""
    if future is None or future.done():
        await rollout.settings.sleep(seconds)
        return
    # No helper task: hundreds of rollouts wait here at once (see interrupt.py).
    async with Interrupt(future):
        await rollout.settings.sleep(seconds)


async def wait_for_agent(rollout: GatewayRollout, until_exit: Awaitable[Any]) -> None:
    """Wait for ``until_exit``, racing the agent timeout and the tunnel's death.

    On timeout the rollout is marked ``agent_timed_out`` (not an error: the policy
    ran too long). A tunnel that dies meanwhile fails the rollout with
    :class:`GatewayTunnelError` at once.
    """
    deadline = asyncio.timeout(rollout.settings.agent_timeout)
    dead = rollout.lease.dead_future() if rollout.lease is not None else None
    # The wait runs in this task (no helper tasks: hundreds of rollouts wait at once).
    try:
        async with deadline, Interrupt(dead) as tunnel_death:
            await until_exit
    except TimeoutError:
        if not deadline.expired():
            raise  # the poll's own failure
        rollout.record.agent_timed_out = True
        return
    if tunnel_death.fired:
        reason = rollout.lease.reason if rollout.lease is not None else ""
        raise GatewayTunnelError(f"the tunnel died while the agent ran ({reason})")


__all__ = ["poll_until_exit", "wait_for_agent"]
