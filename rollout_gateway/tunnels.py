"""How a sandbox reaches the gateway: tunnel providers and the shared tunnel pool.

A :class:`TunnelProvider` opens a :class:`TunnelHandle` to a gateway (host, port) and
gives back its public root URL. The :class:`TunnelPool` keeps one tunnel per gateway
host, shared by every rollout to that host: started once (concurrent rollouts wait for
the same start, rollouts to other hosts never wait on it), health-checked, replaced when
dead, all stopped at teardown.

Providers:
- :class:`PrimeTunnelProvider`: a ``prime_tunnel.Tunnel`` per host, for remote sandboxes.
- :class:`DirectTunnelProvider`: no tunnel; the sandbox uses the gateway URL as given
  (sandboxes in the gateway's network, and the local sandbox backend).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from rollout_gateway.errors import GatewayConfigError, GatewayTunnelError

logger = logging.getLogger(__name__)


@runtime_checkable
class TunnelHandle(Protocol):
    """A running tunnel (or a direct route) to one gateway.

    A handle may also have a ``tunnel_id`` attribute (the provider's id of the tunnel,
    ``str`` or ``None``); the 0.3 mixin puts it in ``state["tunnel_id"]``.
    """

    @property
    def url(self) -> str:
        """Public root URL sandboxes use to reach the gateway (no trailing slash)."""
        ...

    def is_running(self) -> bool:
        """Cheap local liveness check (e.g. the tunnel process is alive)."""
        ...

    async def check_healthy(self) -> bool:
        """Thorough check (e.g. still registered server-side); called periodically."""
        ...

    async def stop(self) -> None:
        """Stop the tunnel. Idempotent."""
        ...


@runtime_checkable
class TunnelProvider(Protocol):
    """Opens tunnels to gateways."""

    async def open(self, gateway_url: str, host: str, port: int) -> TunnelHandle:
        """Open a tunnel to the gateway at ``host:port`` (root URL ``gateway_url``)."""
        ...


class DirectHandle:
    """The gateway URL as given: nothing to start or stop."""

    def __init__(self, url: str) -> None:
        self._url = url.rstrip("/")

    @property
    def url(self) -> str:
        """The gateway root URL."""
        return self._url

    def is_running(self) -> bool:
        """Always true: there is no process."""
        return True

    async def check_healthy(self) -> bool:
        """Always true: there is nothing to re-register."""
        return True

    async def stop(self) -> None:
        """Nothing to stop."""


class DirectTunnelProvider:
    """No tunnel: sandboxes reach the gateway at its own URL (same network, or local)."""

    async def open(self, gateway_url: str, host: str, port: int) -> TunnelHandle:
        """Return the gateway URL itself."""
        return DirectHandle(gateway_url)


class PrimeTunnelHandle:
    """A started ``prime_tunnel.Tunnel``."""

    def __init__(self, tunnel: object, url: str) -> None:
        self._tunnel = tunnel
        self._url = url.rstrip("/")
        self._stopped = False

    @property
    def url(self) -> str:
        """The tunnel's public URL."""
        return self._url

    @property
    def tunnel_id(self) -> str | None:
        """Prime's id of the tunnel (what the earlier mixin put in ``state["tunnel_id"]``)."""
        tunnel_id = getattr(self._tunnel, "tunnel_id", None)
        return tunnel_id if isinstance(tunnel_id, str) else None

    def is_running(self) -> bool:
        """Whether the frpc process is alive."""
        return not self._stopped and bool(getattr(self._tunnel, "is_running", False))

    async def check_healthy(self) -> bool:
        """Whether the tunnel is still registered server-side."""
        return bool(await self._tunnel.check_registered())  # type: ignore[attr-defined]

    async def stop(self) -> None:
        """Stop frpc and deregister the tunnel. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        # sync_stop waits on the frpc process: keep it off the event loop.
        await asyncio.to_thread(self._tunnel.sync_stop)  # type: ignore[attr-defined]


class PrimeTunnelProvider:
    """Prime tunnels (``prime_tunnel.Tunnel``) for sandboxes outside the gateway's network.

    ``tunnel_kwargs`` go to ``Tunnel(...)`` (``team_id``, ``labels``, ``connection_timeout``...).
    """

    def __init__(self, **tunnel_kwargs: object) -> None:
        self.tunnel_kwargs = tunnel_kwargs

    async def open(self, gateway_url: str, host: str, port: int) -> TunnelHandle:
        """Start a tunnel to ``host:port`` and return it once it has a public URL."""
        from prime_tunnel import Tunnel

        tunnel = Tunnel(local_port=port, local_addr=host, **self.tunnel_kwargs)
        try:
            url = await tunnel.start()
        except BaseException:
            await asyncio.to_thread(tunnel.sync_stop)
            raise
        return PrimeTunnelHandle(tunnel, url)


def gateway_host_port(gateway_url: str, default_port: int) -> tuple[str, int]:
    """The (host, port) a tunnel to ``gateway_url`` must point at."""
    parts = urlsplit(gateway_url)
    if not parts.scheme or not parts.hostname:
        raise GatewayConfigError(f"gateway URL {gateway_url!r} has no scheme or host")
    return parts.hostname, parts.port or default_port


class TunnelLease:
    """A rollout's use of one shared tunnel: its URL, and a signal when it dies.

    The pool's monitor calls :meth:`_mark_dead` on every lease of a tunnel it finds
    dead, so a rollout whose agent is still running learns it at once instead of after
    its whole timeout.
    """

    def __init__(self, url: str, *, tunnel_id: str | None = None) -> None:
        self.url = url
        #: The provider's id of the tunnel, when its handle has one (a Prime tunnel's).
        self.tunnel_id = tunnel_id
        self.reason = ""
        self._is_dead = False
        self._dead: asyncio.Future[str] | None = None

    @property
    def is_dead(self) -> bool:
        """Whether the tunnel died while this lease held it."""
        return self._is_dead

    def dead_future(self) -> asyncio.Future[str]:
        """A future resolved with the reason when the tunnel of this lease dies."""
        if self._dead is None:
            self._dead = asyncio.get_running_loop().create_future()
            if self._is_dead:
                self._dead.set_result(self.reason)
        return self._dead

    async def wait_dead(self) -> str:
        """Return (with the reason) once the tunnel of this lease died."""
        return await asyncio.shield(self.dead_future())

    def _mark_dead(self, reason: str) -> None:
        if self._is_dead:
            return
        self.reason = reason
        self._is_dead = True
        if self._dead is not None and not self._dead.done():
            self._dead.set_result(reason)


class TunnelPool:
    """One shared tunnel per gateway (host, port), started once and kept healthy.

    A background monitor (started with the first tunnel) checks every tunnel's process
    each ``liveness_interval`` seconds and its server-side registration each
    ``health_check_interval`` seconds. A dead tunnel's leases are told at once, and a
    replacement is opened in the background, before the next rollout asks for it.

    Args:
        provider: opens the tunnels.
        default_port: port used when a gateway URL names none.
        health_check_interval: seconds between thorough checks of a tunnel.
        liveness_interval: seconds between the monitor's cheap process checks.
        clock: monotonic clock (seconds), injectable for tests.
        sleep: the monitor's sleep, injectable for tests.
    """

    def __init__(
        self,
        provider: TunnelProvider,
        *,
        default_port: int = 8000,
        health_check_interval: float = 30.0,
        liveness_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.provider = provider
        self.default_port = default_port
        self.health_check_interval = health_check_interval
        self.liveness_interval = liveness_interval
        self._clock = clock
        self._sleep = sleep
        self._handles: dict[tuple[str, int], TunnelHandle] = {}
        self._urls: dict[tuple[str, int], str] = {}  # gateway URL a tunnel was opened for
        self._leases: dict[tuple[str, int], weakref.WeakSet[TunnelLease]] = {}
        self._last_checked: dict[tuple[str, int], float] = {}
        # One lock per host: rollouts to one host share one start; other hosts never wait.
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._replacing: set[asyncio.Task[None]] = set()
        self._closed = False
        #: How many tunnels were opened (benchmarks and tests read it).
        self.starts = 0

    def __len__(self) -> int:
        return len(self._handles)

    async def lease(self, gateway_url: str) -> TunnelLease:
        """A lease on the tunnel of ``gateway_url``, opening or replacing it as needed."""
        key = gateway_host_port(gateway_url, self.default_port)
        handle = await self._healthy_handle(gateway_url, key)
        lease = TunnelLease(handle.url, tunnel_id=getattr(handle, "tunnel_id", None))
        self._leases.setdefault(key, weakref.WeakSet()).add(lease)
        return lease

    async def get_url(self, gateway_url: str) -> str:
        """Public root URL for ``gateway_url``, opening or replacing the tunnel as needed."""
        return (await self.lease(gateway_url)).url

    def gateway_urls(self) -> list[str]:
        """The gateway URLs a tunnel was opened for (one per gateway host and port)."""
        return list(dict.fromkeys(self._urls[key] for key in self._handles if key in self._urls))

    async def _healthy_handle(self, gateway_url: str, key: tuple[str, int]) -> TunnelHandle:
        if self._closed:
            raise GatewayTunnelError("tunnel pool is closed (env torn down)")
        handle = self._handles.get(key)
        if handle is not None and handle.is_running() and not self._check_due(key):
            return handle  # fast path: no lock for the common case
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            handle = self._handles.get(key)
            if handle is not None and not await self._is_healthy(key, handle):
                await self._retire(key, handle, "tunnel found dead")
                handle = None
            if handle is None:
                if self._closed:
                    raise GatewayTunnelError("tunnel pool is closed (env torn down)")
                handle = await self._open(gateway_url, key)
            return handle

    async def invalidate(self, gateway_url: str) -> None:
        """Drop and stop the tunnel of ``gateway_url`` (e.g. found dead by a rollout)."""
        key = gateway_host_port(gateway_url, self.default_port)
        handle = self._handles.get(key)
        if handle is not None:
            await self._retire(key, handle, "tunnel invalidated")

    async def check_now(self) -> None:
        """One monitor pass: retire dead tunnels and start their replacements."""
        for key, handle in list(self._handles.items()):
            if self._closed:
                return
            if await self._is_healthy(key, handle):
                continue
            await self._retire(key, handle, "tunnel died")
            if not self._closed:
                task = asyncio.ensure_future(self._replace(key))
                self._replacing.add(task)
                task.add_done_callback(self._replacing.discard)

    async def stop_all(self) -> None:
        """Stop every tunnel and the monitor, once. Idempotent; later leases fail."""
        self._closed = True
        # Tasks of another (closed) loop, e.g. an atexit teardown, can be neither
        # cancelled nor awaited here; they died with their loop.
        loop = asyncio.get_running_loop()
        tasks = [
            t for t in (self._monitor, *self._replacing) if t is not None and t.get_loop() is loop
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._monitor = None
        handles = list(self._handles.items())
        self._handles.clear()
        for key, _ in handles:
            self._tell_leases(key, "tunnel pool stopped")
        await asyncio.gather(*(_stop_quietly(h) for _, h in handles))

    def _check_due(self, key: tuple[str, int]) -> bool:
        return self._clock() - self._last_checked.get(key, 0.0) >= self.health_check_interval

    async def _is_healthy(self, key: tuple[str, int], handle: TunnelHandle) -> bool:
        if not handle.is_running():
            return False
        if not self._check_due(key):
            return True
        self._last_checked[key] = self._clock()
        try:
            return await handle.check_healthy()
        except Exception as e:  # a failed check is not proof of death: keep the tunnel
            logger.warning("tunnel health check for %s:%s failed: %s", *key, e)
            return True

    async def _retire(self, key: tuple[str, int], handle: TunnelHandle, reason: str) -> None:
        if self._handles.get(key) is handle:
            del self._handles[key]
        logger.warning("%s: %s:%s (%s)", reason, *key, handle.url)
        self._tell_leases(key, f"{reason}: {handle.url}")
        await _stop_quietly(handle)

    def _tell_leases(self, key: tuple[str, int], reason: str) -> None:
        for lease in list(self._leases.pop(key, ())):
            lease._mark_dead(reason)

    async def _replace(self, key: tuple[str, int]) -> None:
        try:
            await self._healthy_handle(self._urls[key], key)
        except Exception as e:  # the next lease tries again
            logger.warning("replacing the tunnel to %s:%s failed: %s", *key, e)

    async def _monitor_loop(self) -> None:
        while not self._closed:
            await self._sleep(self.liveness_interval)
            try:
                await self.check_now()
            except Exception as e:  # the monitor must outlive any one bad check
                logger.warning("tunnel monitor pass failed: %s", e)

    async def _open(self, gateway_url: str, key: tuple[str, int]) -> TunnelHandle:
        host, port = key
        try:
            handle = await self.provider.open(gateway_url, host, port)
        except GatewayTunnelError:
            raise
        except Exception as e:
            raise GatewayTunnelError(f"could not open a tunnel to {host}:{port}: {e}") from e
        self.starts += 1
        if self._closed:  # torn down while this tunnel was starting: do not leak it
            await _stop_quietly(handle)
            raise GatewayTunnelError("tunnel pool is closed (env torn down)")
        self._handles[key] = handle
        self._urls[key] = gateway_url
        self._last_checked[key] = self._clock()
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.ensure_future(self._monitor_loop())
        logger.info("tunnel to %s:%s open at %s", host, port, handle.url)
        return handle


async def _stop_quietly(handle: TunnelHandle) -> None:
    try:
        await handle.stop()
    except Exception as e:
        logger.warning("error stopping tunnel %s: %s", handle.url, e)


__all__ = [
    "DirectHandle",
    "DirectTunnelProvider",
    "PrimeTunnelHandle",
    "PrimeTunnelProvider",
    "TunnelHandle",
    "TunnelLease",
    "TunnelPool",
    "TunnelProvider",
    "gateway_host_port",
]
