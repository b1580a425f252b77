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
from collections.abc import Callable
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from rollout_gateway.errors import GatewayConfigError, GatewayTunnelError

logger = logging.getLogger(__name__)


@runtime_checkable
class TunnelHandle(Protocol):
    """A running tunnel (or a direct route) to one gateway."""

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

        tunnel = Tunnel(local_port=port, local_addr=host, **self.tunnel_kwargs)  # type: ignore[arg-type]
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


class TunnelPool:
    """One shared tunnel per gateway (host, port), started once and kept healthy.

    Args:
        provider: opens the tunnels.
        default_port: port used when a gateway URL names none.
        health_check_interval: seconds between thorough checks of a tunnel.
        clock: monotonic clock (seconds), injectable for tests.
    """

    def __init__(
        self,
        provider: TunnelProvider,
        *,
        default_port: int = 8000,
        health_check_interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.provider = provider
        self.default_port = default_port
        self.health_check_interval = health_check_interval
        self._clock = clock
        self._handles: dict[tuple[str, int], TunnelHandle] = {}
        self._last_checked: dict[tuple[str, int], float] = {}
        # One lock per host: rollouts to one host share one start; other hosts never wait.
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._closed = False
        #: How many tunnels were opened (benchmarks and tests read it).
        self.starts = 0

    def __len__(self) -> int:
        return len(self._handles)

    async def get_url(self, gateway_url: str) -> str:
        """Public root URL for ``gateway_url``, opening or replacing the tunnel as needed."""
        if self._closed:
            raise GatewayTunnelError("tunnel pool is closed (env torn down)")
        key = gateway_host_port(gateway_url, self.default_port)
        handle = self._handles.get(key)
        if handle is not None and handle.is_running() and not self._check_due(key):
            return handle.url  # fast path: no lock for the common case
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            handle = self._handles.get(key)
            if handle is not None and not await self._is_healthy(key, handle):
                logger.warning("tunnel to %s:%s is dead, replacing it", *key)
                self._handles.pop(key, None)
                await _stop_quietly(handle)
                handle = None
            if handle is None:
                if self._closed:
                    raise GatewayTunnelError("tunnel pool is closed (env torn down)")
                handle = await self._open(gateway_url, key)
            return handle.url

    async def invalidate(self, gateway_url: str) -> None:
        """Drop and stop the tunnel of ``gateway_url`` (e.g. found dead by a rollout)."""
        key = gateway_host_port(gateway_url, self.default_port)
        handle = self._handles.pop(key, None)
        if handle is not None:
            await _stop_quietly(handle)

    async def stop_all(self) -> None:
        """Stop every tunnel, once. Idempotent; later :meth:`get_url` calls fail."""
        self._closed = True
        handles = list(self._handles.values())
        self._handles.clear()
        await asyncio.gather(*(_stop_quietly(h) for h in handles))

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
        self._last_checked[key] = self._clock()
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
    "TunnelPool",
    "TunnelProvider",
    "gateway_host_port",
]
