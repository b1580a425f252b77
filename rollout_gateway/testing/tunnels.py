"""A fake tunnel provider: :class:`FakeTunnelProvider` (no tunnel extra needed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class FakeTunnelHandle:
    """A fake tunnel; ``alive = False`` simulates a dead frpc process."""

    def __init__(self, url: str, tunnel_id: str | None = None) -> None:
        self._url = url
        #: The provider's id of the tunnel (as ``prime_tunnel.Tunnel.tunnel_id``).
        self.tunnel_id = tunnel_id
        self.alive = True
        self.registered = True
        self.stops = 0

    @property
    def url(self) -> str:
        """The public URL."""
        return self._url

    def is_running(self) -> bool:
        """Whether the fake process lives."""
        return self.alive

    async def check_healthy(self) -> bool:
        """Whether the fake tunnel is still registered."""
        return self.registered

    async def stop(self) -> None:
        """Stop (counted)."""
        self.stops += 1
        self.alive = False


class FakeTunnelProvider:
    """Opens :class:`FakeTunnelHandle` s; ``start_latency`` seconds each; counts opens.

    The public URL is ``https://tunnel-{n}.example`` so tests can tell tunnels apart.
    ``fail_next`` makes the next opens raise it.
    """

    def __init__(self, start_latency: float = 0.0) -> None:
        self.start_latency = start_latency
        self.opened: list[tuple[str, int]] = []
        self.handles: list[FakeTunnelHandle] = []
        self.fail_next: list[BaseException] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def open(self, gateway_url: str, host: str, port: int) -> FakeTunnelHandle:
        """Open a fake tunnel to ``host:port``."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await _sleep(self.start_latency)
            if self.fail_next:
                raise self.fail_next.pop(0)
            self.opened.append((host, port))
            n = len(self.opened)
            handle = FakeTunnelHandle(f"https://tunnel-{n}.example", tunnel_id=f"tunnel-{n}")
            self.handles.append(handle)
            return handle
        finally:
            self.in_flight -= 1


async def _sleep(latency: float | Callable[[], float]) -> None:
    seconds = latency() if callable(latency) else latency
    if seconds:
        await asyncio.sleep(seconds)


__all__ = ["FakeTunnelHandle", "FakeTunnelProvider"]
