"""A gateway's start and end: its state opened once, on the loop that serves it.

:func:`open_state` opens the store and the coordinator and holds again what the store
held (rollouts, exit reports, the policy version). The app's lifespan
(:func:`lifespan`) runs it, probes the engines, runs the idle sweep and the health probe
of the upstreams and the store (:mod:`.ops.health`; what the first probe finds down is
logged as a warning), and at the end finishes the background writes and closes both.
:func:`~rollout_gateway.server.runner.serve` runs :func:`open_state` on the serving loop
before the server binds, so that a store that cannot be used is refused before serving,
with its reason; the lifespan then finds it open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from rollout_gateway.server.context import GatewayContext
from rollout_gateway.server.engines.probe import probe_engine

if TYPE_CHECKING:
    from rollout_gateway.server.control.exit_stream import ExitStreams
    from rollout_gateway.server.engines.probe import EngineInfo
    from rollout_gateway.server.ops.health import HealthMonitor
    from rollout_gateway.server.state.registry import RolloutRecord

logger = logging.getLogger("rollout_gateway.server")


class ServingGateway(GatewayContext, Protocol):
    """What a gateway's start and end use of it (:class:`~.app.Gateway`; typed here as a
    protocol so that this module never imports the one that imports it)."""

    #: Whether the store and the coordinator are open.
    state_open: bool
    #: What runs behind each upstream.
    engines: dict[str, EngineInfo]
    #: The open exit streams.
    exit_streams: ExitStreams
    #: The probe of the upstreams and the store (``/health``).
    health_monitor: HealthMonitor

    def pin_loaded(self, record: RolloutRecord) -> None:
        """Pin a restored rollout to its upstream (another when it is gone)."""
        ...

    def sweep(self) -> int:
        """Expire idle rollouts now."""
        ...


async def open_state(gateway: ServingGateway) -> None:
    """Open the gateway's store and coordinator and hold again what the store held: its
    rollouts (pinned to their upstream, or to another when it is no longer configured),
    exit reports and the policy version. Idempotent until :func:`lifespan` closes them.

    Raises :class:`~rollout_gateway.server.state.store.StoreError` (a store the gateway
    cannot use: unwritable, another version's, damaged beyond what can be kept).
    """
    if gateway.state_open:
        return
    contents = await gateway.store.open()
    rows = await gateway.coordinator.open(contents)
    gateway.state_open = True
    for problem in contents.damage:
        logger.error("state store %s: %s", gateway.store.name, problem)
    for record in gateway.rollouts.restore(rows):
        gateway.pin_loaded(record)
    gateway.exit_board.restore(contents.exits, contents.exit_cursor)
    if contents.policy.version is not None:
        gateway.policy.adopt(contents.policy.version, contents.policy.updated_at)
    if rows:
        logger.info("state: %d rollouts restored from the %s store", len(rows), gateway.store.name)


async def _close_state(gateway: ServingGateway) -> None:
    await gateway.rollouts.drain()
    await gateway.coordinator.close()
    await gateway.store.close()
    gateway.state_open = False


async def _probe_engines(gateway: ServingGateway) -> None:
    pool, token_in = gateway.pool, gateway.token_in
    await asyncio.gather(
        *(
            probe_engine(pool.get(url).http, info, pool.get(url).label)
            for url, info in gateway.engines.items()
        ),
        *(token_in.probe(upstream) for upstream in pool.upstreams if token_in is not None),
    )


async def _periodic(interval_s: float, action: Callable[[], object]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            result = action()
            if asyncio.iscoroutine(result):
                await result
        except Exception:  # a failed sweep must not kill the loop
            logger.exception("periodic task failed")


def _warn_unreachable(gateway: ServingGateway) -> None:
    """Say at start, loudly, what the first health probe found down: turns fail with a
    502 (or a 503 for the store) until it answers, and ``/health`` answers 503 while no
    upstream (or the store) answers."""
    for line in gateway.health_monitor.unreachable_at_start():
        logger.warning(
            "%s: turns routed there fail until it answers; /health answers 503 while no "
            "upstream (or the state store) answers",
            line,
        )


@contextlib.asynccontextmanager
async def lifespan(gateway: ServingGateway, app: Any = None) -> AsyncIterator[None]:
    """The app's lifespan: open the state (:func:`open_state`), probe the engines and
    the health of the upstreams and the store, run the idle sweep and the health probe;
    at the end, finish the state's writes and close it."""
    await open_state(gateway)
    await asyncio.gather(_probe_engines(gateway), gateway.health_monitor.probe())
    _warn_unreachable(gateway)
    config = gateway.config
    tasks = [
        asyncio.create_task(_periodic(config.registry.sweep_interval_s, gateway.sweep)),
        asyncio.create_task(gateway.health_monitor.run()),
    ]
    try:
        yield
    finally:
        gateway.exit_streams.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gateway.pool.aclose()
        await _close_state(gateway)


__all__ = ["lifespan", "open_state"]
