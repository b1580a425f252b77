"""The gateway's connection caps come from the process's file-descriptor limit (issue 26)."""

from __future__ import annotations

import resource

import pytest

from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.http.fds import (
    DEFAULT_MAX_CONNECTIONS,
    MIN_AGENT_CONNECTIONS,
    RESERVED_FDS,
    fd_limit,
    plan_fds,
)

from ..conftest import ADMIN_TOKEN, UPSTREAM


def test_a_low_limit_is_shared_and_never_overdrawn() -> None:
    plan = plan_fds(256, max_connections=None, per_upstream_pool=1024, upstream_pools=2)
    # 64 reserved; a third of the 192 left for the two upstream pools; the rest for agents.
    assert plan.upstream_connections == 32 and plan.agent_connections == 128
    assert plan.agent_connections + 2 * plan.upstream_connections + RESERVED_FDS <= 256


def test_a_generous_limit_keeps_the_defaults() -> None:
    plan = plan_fds(1 << 20, max_connections=None, per_upstream_pool=1024, upstream_pools=2)
    assert (plan.agent_connections, plan.upstream_connections) == (DEFAULT_MAX_CONNECTIONS, 1024)
    explicit = plan_fds(1 << 20, max_connections=10, per_upstream_pool=1024, upstream_pools=2)
    assert explicit.agent_connections == 10


def test_a_cap_the_limit_cannot_hold_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"--max-connections 4096.*RLIMIT_NOFILE 256.*ulimit -n"):
        plan_fds(256, max_connections=4096, per_upstream_pool=1024, upstream_pools=2)
    with pytest.raises(ValueError, match="too low to serve"):
        plan_fds(100, max_connections=None, per_upstream_pool=1024, upstream_pools=2)
    assert plan_fds(100, max_connections=4, per_upstream_pool=8, upstream_pools=1)
    assert MIN_AGENT_CONNECTIONS <= 128


def test_the_gateway_takes_its_caps_from_the_process_limit() -> None:
    app = create_app(GatewayConfig(upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN))
    plan = app.state.gateway.fd_plan
    assert plan.nofile == fd_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        assert plan.agent_connections + RESERVED_FDS <= soft
    # The exit streams hold connections: at most half of the cap.
    assert app.state.gateway.exit_streams.max_streams <= max(1, plan.agent_connections // 2)
