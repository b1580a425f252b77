"""Waiting for a rollout's agent: exit reports, sandbox polling, timeout, tunnel death.

The waiting half of :class:`rollout_gateway.lifecycle.GatewayRollout` (whose
``poll_until_exit`` and ``wait_for_agent`` call these). Hundreds of rollouts wait at
once during a burst, so a wait holds no helper task: the agent timeout, the tunnel's
death and the exit report end it in the rollout's own task
(:class:`rollout_gateway.interrupt.Interrupt`, :func:`asyncio.timeout`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rollout_gateway.errors import AgentPollError, GatewayTunnelError
from rollout_gateway.interrupt import Interrupt

if TYPE_CHECKING:
    from rollout_gateway.lifecycle import AgentExit, GatewayRollout

logger = logging.getLogger(__name__)


async def poll_until_exit(
    rollout: GatewayRollout,
    probe: Callable[[], Awaitable[AgentExit | None]],
    *,
    is_transient: Callable[[BaseException], bool] = lambda e: False,
) -> AgentExit:
    """Call ``probe`` (``None`` while the agent runs) until the agent exited.

    With exit reports on and a gateway that has them, ``probe`` runs when the agent's
    report arrives (to confirm it: the agent could lie) and otherwise only every
    ``safety_interval`` s; without them, on the poll policy's adaptive interval.
    Transient probe errors are tolerated up to the policy's limit in a row.
    """
    policy = rollout.settings.poll
    clock = rollout.settings.clock
    started = clock()
    read_errors = 0
    watcher = hint = None
    if rollout.settings.exit_reports and rollout.record.gateway_url is not None:
        watcher = rollout.resources.exit_watcher(rollout.record.gateway_url)
        hint = watcher.subscribe(rollout.rollout_id)
    try:
        if hint is not None:  # the agent just started: wait for its report first
            await _sleep_or_hint(rollout, policy.min_interval, hint)
            if not hint.done() and watcher is not None and watcher.supported:
                await _sleep_or_hint(rollout, policy.safety_interval, hint)
        while True:
            rollout.record.agent_polls += 1
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
                    rollout.record.agent_exit = result
                    return result
            if hint is not None and hint.done():
                hint = None  # a report the sandbox did not confirm: poll from now on
            interval = policy.interval(clock() - started)
            if hint is not None and watcher is not None and watcher.supported:
                interval = policy.safety_interval
            await _sleep_or_hint(rollout, interval, hint)
    finally:
        if watcher is not None:
            watcher.unsubscribe(rollout.rollout_id)


async def _sleep_or_hint(
    rollout: GatewayRollout, seconds: float, hint: asyncio.Future[int | None] | None
) -> None:
    """Sleep ``seconds`` (the settings' sleep), or less if ``hint`` resolves first."""
    if hint is None or hint.done():
        await rollout.settings.sleep(seconds)
        return
    # No helper task: hundreds of rollouts wait here at once (see interrupt.py).
    async with Interrupt(hint):
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
