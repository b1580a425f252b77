"""Waiting for a rollout's agent: exit reports, sandbox polling, refusals, timeout, tunnel death.

The waiting half of a :class:`rollout_gateway.lifecycle.GatewayRollout`: an adapter's
wait step calls :func:`wait_for_agent` around :func:`poll_until_exit` (imports go this
way: this module uses the rollout, the rollout does not know it). Hundreds of rollouts
wait at once during a burst, so a wait holds no helper task: the agent timeout, the
tunnel's death and the exit channel end it in the rollout's own task
(:class:`rollout_gateway.interrupt.Interrupt`, :func:`asyncio.timeout`).

What the exit channel (:mod:`rollout_gateway.exits`) says about the rollout decides how
often its sandbox is asked: :class:`~rollout_gateway.polling.ExitPollPlan` decides, this
module runs it (a refusal: the adapter's ``on_refusal`` stops the agent at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rollout_gateway.errors import AgentPollError, GatewayTunnelError
from rollout_gateway.interrupt import Interrupt
from rollout_gateway.lifecycle import AgentExit, GatewayRollout
from rollout_gateway.polling import ExitPollPlan
from rollout_gateway.protocol import ExitReport

if TYPE_CHECKING:
    from rollout_gateway.exits import ExitWatcher

logger = logging.getLogger(__name__)


class _Channel:
    """One rollout's subscription to its gateway's exit channel (reports one at a time);
    with no watcher (exit reports off), a channel that never reports."""

    def __init__(self, watcher: ExitWatcher | None, rollout_id: str) -> None:
        self.watcher = watcher
        self.rollout_id = rollout_id
        self._next: asyncio.Future[ExitReport] | None = None
        if watcher is not None:
            self._next = watcher.subscribe_report(rollout_id)

    @classmethod
    def of(cls, rollout: GatewayRollout) -> _Channel:
        """The exit channel of ``rollout``'s gateway, when exit reports are on."""
        record = rollout.record
        if not rollout.settings.exit_reports or record.gateway_url is None:
            return cls(None, record.rollout_id)
        return cls(rollout.resources.exit_watcher(record.gateway_url), record.rollout_id)

    @property
    def supported(self) -> bool | None:
        """Whether the gateway has exit reports (``None`` until it answered once)."""
        return self.watcher.supported if self.watcher is not None else None

    async def wait(self, rollout: GatewayRollout, seconds: float) -> ExitReport | None:
        """Sleep ``seconds`` (the settings' sleep), or less if a report comes first."""
        future = self._next
        if future is None or not future.done():
            await _sleep_or(rollout, seconds, future)
        if future is None or not future.done() or future.cancelled():
            return None
        assert self.watcher is not None
        self._next = self.watcher.subscribe_report(self.rollout_id)
        return future.result()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.unsubscribe(self.rollout_id)


async def poll_until_exit(
    rollout: GatewayRollout,
    probe: Callable[[], Awaitable[AgentExit | None]],
    *,
    is_transient: Callable[[BaseException], bool] = lambda e: False,
    on_refusal: Callable[[], Awaitable[Any]] | None = None,
) -> AgentExit:
    """Call ``probe`` (``None`` while the agent runs) until the agent exited.

    How often: :class:`~rollout_gateway.polling.ExitPollPlan`, from what the exit channel
    says. ``on_refusal`` stops the agent when the gateway reports that it refused a turn
    (``record.refused`` then holds the refusal's code). Transient probe errors are
    tolerated up to the policy's limit in a row.
    """
    record, clock = rollout.record, rollout.settings.clock
    channel = _Channel.of(rollout)
    watching = channel.watcher is not None
    # An exit report can come: the agent runs behind the reporting wrapper (the adapter
    # says so) and the gateway is watched.
    expect = watching and record.agent_reports
    plan = ExitPollPlan(rollout.settings.poll, clock(), watching=watching, expect=expect)
    step = plan.first()
    try:
        while True:
            report = await channel.wait(rollout, step.seconds)
            supported, refused = channel.supported, record.refused is not None
            step = plan.heard(report, now=clock(), supported=supported, refused=refused)
            if step.action == "wait":
                continue
            if step.action == "stop":
                assert report is not None
                record.refused = report["refused"]
                await _stop_refused(record.rollout_id, record.refused, on_refusal)
            record.agent_polls += 1
            try:
                result = await probe()
            except Exception as e:
                if not is_transient(e):
                    raise AgentPollError(f"polling the agent failed: {e}") from e
                retry = plan.probe_failed(report, now=clock(), supported=supported)
                if retry is None:
                    raise AgentPollError(
                        f"polling the agent failed {plan.read_errors} times in a row: {e}"
                    ) from e
                logger.warning("rollout=%s transient poll error: %s", rollout.rollout_id, e)
                step = retry
                continue
            if result is not None:
                record.agent_exit = result
                return result
            step = plan.probed(report, now=clock(), supported=supported)
    finally:
        channel.close()


async def _stop_refused(
    rollout_id: str, code: str, on_refusal: Callable[[], Awaitable[Any]] | None
) -> None:
    """The gateway refused a turn: the rollout is over, its agent stopped now."""
    logger.info("rollout=%s the gateway refused a turn (%s): stopping the agent", rollout_id, code)
    if on_refusal is None:
        return
    try:
        await on_refusal()
    except Exception as e:  # the probe after it still tells whether the agent ended
        logger.warning("rollout=%s stopping the agent failed: %s", rollout_id, e)


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


async def wait_for_agent(
    rollout: GatewayRollout, until_exit: Awaitable[Any], *, agent_timeout: bool = True
) -> None:
    """Wait for ``until_exit``, racing the agent timeout and the tunnel's death.

    On timeout (the settings' ``agent_timeout``, unless ``agent_timeout`` is false) the
    rollout is marked ``agent_timed_out`` (not an error: the policy ran too long). A
    tunnel that dies meanwhile fails the rollout with :class:`GatewayTunnelError` at once.
    """
    deadline = asyncio.timeout(rollout.settings.agent_timeout if agent_timeout else None)
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
