"""The env-wide resources of gateway mode: control-plane clients, tunnels, rollouts in flight.

One :class:`GatewayResources` per env, shared by all its rollouts. Closing it ends the
rollouts still in flight (each finalizes: cancel, unregister, delete), then closes the
HTTP clients and stops every tunnel, and refuses to open anything afterwards, so a
rollout finalizing late cannot re-create a client nobody closes.

:class:`ResourcesOwner` holds an env's current one across its teardowns: a rollout
started after a teardown gets a fresh one, which is closed when the last rollout using
it ends (nothing else would close it: the env's teardown has already run).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from rollout_gateway.client import GatewayClient
from rollout_gateway.errors import GatewayUnavailableError
from rollout_gateway.exits import ExitWatcher
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.tunnels import TunnelPool, TunnelProvider

logger = logging.getLogger(__name__)


class GatewayResources:
    """Pooled clients (one per gateway), the shared tunnel pool and the rollouts in flight.

    Args:
        settings: the env's gateway settings.
        tunnel_provider: the provider of the pool's tunnels.
    """

    def __init__(self, settings: GatewaySettings, tunnel_provider: TunnelProvider) -> None:
        self.settings = settings
        self.tunnels = TunnelPool(
            tunnel_provider,
            default_port=settings.gateway_port,
            health_check_interval=settings.tunnel_health_check_interval,
            liveness_interval=settings.tunnel_liveness_interval,
            clock=settings.clock,
            sleep=settings.sleep,
        )
        self._clients: dict[str, GatewayClient] = {}
        self._watchers: dict[str, ExitWatcher] = {}
        self._in_flight: set[asyncio.Task[object]] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    @property
    def in_flight(self) -> int:
        """How many rollouts are running now."""
        return len(self._in_flight)

    def client(self, gateway_url: str) -> GatewayClient:
        """The pooled control-plane client of ``gateway_url`` (one per gateway)."""
        if self._closed:
            raise GatewayUnavailableError("gateway resources are closed (env torn down)")
        client = self._clients.get(gateway_url)
        if client is None:
            client = GatewayClient(
                gateway_url,
                admin_token=self.settings.resolved_admin_token(),
                retry=self.settings.retry,
                transport=self.settings.transport,
                auth_help=self.settings.admin_token_help(),
            )
            self._clients[gateway_url] = client
        return client

    def exit_watcher(self, gateway_url: str) -> ExitWatcher:
        """The exit-report watcher of ``gateway_url`` (one exit stream per gateway)."""
        watcher = self._watchers.get(gateway_url)
        if watcher is None:
            watcher = ExitWatcher(self.client(gateway_url), sleep=self.settings.sleep)
            self._watchers[gateway_url] = watcher
        return watcher

    def track(self, task: asyncio.Task[object]) -> None:
        """Count ``task`` (a running rollout) in flight until it finishes."""
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def aclose(self, *, grace: float = 60.0) -> None:
        """End rollouts in flight (bounded by ``grace`` s), close clients, stop tunnels.

        Idempotent. Rollouts are cancelled and awaited first so their own finalize
        path unregisters and deletes what they hold while the clients still work.
        """
        current = asyncio.current_task()
        loop = asyncio.get_running_loop()  # tasks of a closed loop died with it
        tasks = [
            t for t in self._in_flight if t is not current and not t.done() and t.get_loop() is loop
        ]
        for task in tasks:
            task.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:
                logger.warning("%d rollout(s) did not finish within %.0fs", len(pending), grace)
        self._closed = True
        watchers = list(self._watchers.values())
        self._watchers.clear()
        for watcher in watchers:
            await watcher.aclose()
        clients = list(self._clients.values())
        self._clients.clear()
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        await self.tunnels.stop_all()


class ResourcesOwner:
    """The env's current :class:`GatewayResources`: made on first use, closed by the
    env's teardown (:meth:`teardown`). After a teardown, rollouts still run: the first one
    makes a fresh set, the rollouts then running share it (:meth:`acquire` /
    :meth:`release`), and the last to end closes it, so nothing made after the teardown
    outlives its rollouts.

    Args:
        make: builds a fresh :class:`GatewayResources` (the env's settings and provider).
    """

    def __init__(self, make: Callable[[], GatewayResources]) -> None:
        self._make = make
        self._current: GatewayResources | None = None
        self._users = 0
        self._torn_down = False

    @property
    def current(self) -> GatewayResources | None:
        """The open set, if any (``None`` before first use and after it was closed)."""
        return self._current

    def get(self) -> GatewayResources:
        """The current set, made now when there is none. Outside a rollout (an env's own
        setup calling for a tunnel) after a teardown with no rollout running, it is
        refused: nothing would close what it opened."""
        if self._current is None:
            if self._torn_down and self._users == 0:
                raise GatewayUnavailableError(
                    "the env was torn down: gateway resources open again only for a rollout"
                )
            self._current = self._make()
        return self._current

    def acquire(self) -> GatewayResources:
        """The set a rollout uses until its :meth:`release`."""
        self._users += 1
        try:
            return self.get()
        except BaseException:
            self._users -= 1
            raise

    async def release(self, resources: GatewayResources) -> None:
        """A rollout is done with ``resources``; after a teardown, the last user closes them."""
        if resources is not self._current:
            return  # a teardown took that set and closed it
        self._users -= 1
        if self._torn_down and self._users == 0:
            self._current = None
            await resources.aclose()  # in the rollout's task: aclose does not cancel it

    async def teardown(self) -> None:
        """The env's teardown: close the current set (its rollouts are cancelled and
        finalize first, see :meth:`GatewayResources.aclose`). Idempotent."""
        self._torn_down = True
        resources, self._current = self._current, None
        self._users = 0
        if resources is not None:
            await resources.aclose()


__all__ = ["GatewayResources", "ResourcesOwner"]
