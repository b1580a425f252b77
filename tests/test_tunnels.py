"""TunnelPool and providers: one tunnel per host, health checks, teardown."""

from __future__ import annotations

import asyncio

import pytest

from rollout_gateway import DirectTunnelProvider, GatewayConfigError, GatewayTunnelError, TunnelPool
from rollout_gateway.testing import FakeTunnelProvider


async def test_concurrent_gets_for_one_host_start_one_tunnel():
    provider = FakeTunnelProvider(start_latency=0.05)
    pool = TunnelPool(provider)
    urls = await asyncio.gather(*(pool.get_url("http://gw:8000") for _ in range(50)))
    assert set(urls) == {"https://tunnel-1.example"}
    assert pool.starts == 1 and provider.opened == [("gw", 8000)]


async def test_hosts_do_not_wait_for_each_other():
    provider = FakeTunnelProvider(start_latency=0.2)
    pool = TunnelPool(provider)
    await asyncio.gather(pool.get_url("http://a:1"), pool.get_url("http://b:2"))
    assert provider.max_in_flight == 2


async def test_failed_health_check_replaces_the_tunnel():
    now = [0.0]
    provider = FakeTunnelProvider()
    pool = TunnelPool(provider, health_check_interval=60, clock=lambda: now[0])
    assert await pool.get_url("http://gw:8000") == "https://tunnel-1.example"
    provider.handles[0].registered = False  # expired server-side; process still alive
    assert await pool.get_url("http://gw:8000") == "https://tunnel-1.example"  # not due yet
    now[0] = 61
    assert await pool.get_url("http://gw:8000") == "https://tunnel-2.example"
    assert provider.handles[0].stops == 1


async def test_open_failure_is_a_typed_tunnel_error_and_next_call_retries():
    provider = FakeTunnelProvider()
    provider.fail_next.append(OSError("frpc binary missing"))
    pool = TunnelPool(provider)
    with pytest.raises(GatewayTunnelError, match="frpc binary missing"):
        await pool.get_url("http://gw:8000")
    assert await pool.get_url("http://gw:8000") == "https://tunnel-1.example"


async def test_stop_all_is_idempotent_and_closes_the_pool():
    provider = FakeTunnelProvider()
    pool = TunnelPool(provider)
    await pool.get_url("http://a:1")
    await pool.get_url("http://b:1")
    await pool.stop_all()
    await pool.stop_all()
    assert [h.stops for h in provider.handles] == [1, 1]
    with pytest.raises(GatewayTunnelError, match="closed"):
        await pool.get_url("http://a:1")


async def test_teardown_during_a_start_does_not_leak_the_tunnel():
    provider = FakeTunnelProvider(start_latency=0.1)
    pool = TunnelPool(provider)
    pending = asyncio.ensure_future(pool.get_url("http://gw:8000"))
    await asyncio.sleep(0.02)
    await pool.stop_all()
    with pytest.raises(GatewayTunnelError):
        await pending
    assert [h.stops for h in provider.handles] == [1]


async def test_direct_provider_uses_the_gateway_url_and_default_port():
    pool = TunnelPool(DirectTunnelProvider(), default_port=9999)
    assert await pool.get_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert len(pool) == 1
    with pytest.raises(GatewayConfigError):
        await pool.get_url("not a url")
