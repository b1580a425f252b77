"""Configuration of the reference rollout gateway server."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Uvicorn keep-alive (seconds). Must exceed the idle timeout of client connection pools
#: (httpx's default ``keepalive_expiry`` is 5 s, the OpenAI SDK's is the same): if the
#: server closed idle connections first, a client could send its next turn on a socket the
#: server is closing at that very moment and get a spurious connection reset.
DEFAULT_KEEP_ALIVE_S = 75


@dataclass
class GatewayConfig:
    """Settings of one gateway instance (see ``rollout-gateway serve --help``).

    Attributes:
        upstreams: OpenAI base URLs of the inference servers (``http://h:p/v1``).
        enabled: when false, register answers 503 (the gateway is switched off).
        require_rollout_keys: register hands out a per-rollout ``api_key`` that chat
            requests must present as ``Authorization: Bearer``.
        admin_token: when set, register / cancel / unregister / trajectory require
            ``Authorization: Bearer <admin_token>``.
        rollout_ttl_s: rollouts idle (no call) for longer than this are dropped.
        max_rollouts: registry bound; register answers 503 past it.
        upstream_timeout_s: timeout of one upstream chat completion.
        upstream_connect_timeout_s: connect timeout to an upstream (fail fast when down).
        max_body_bytes: largest accepted request body (413 beyond).
        sweep_interval_s: period of the idle-rollout sweep.
        probe_interval_s: period of the re-probe of unhealthy upstreams.
        upstream_api_key: bearer token sent to the upstreams (e.g. vLLM ``--api-key``).
        max_connections_per_upstream: size of each upstream's HTTP connection pool.
        stream_keepalive_s: a streaming agent gets an SSE keepalive comment after this
            many seconds without a chunk (tunnels and proxies drop silent connections).
    """

    upstreams: list[str] = field(default_factory=list)
    enabled: bool = True
    require_rollout_keys: bool = False
    admin_token: str | None = None
    rollout_ttl_s: float = 3600.0
    max_rollouts: int = 10_000
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 5.0
    max_body_bytes: int = 32 * 1024 * 1024
    sweep_interval_s: float = 30.0
    probe_interval_s: float = 5.0
    upstream_api_key: str | None = None
    max_connections_per_upstream: int = 1024
    stream_keepalive_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one upstream base URL is required")
        self.upstreams = [u.rstrip("/") for u in self.upstreams]
        if self.max_rollouts < 1:
            raise ValueError("max_rollouts must be >= 1")
        if self.rollout_ttl_s <= 0:
            raise ValueError("rollout_ttl_s must be > 0")
        if self.stream_keepalive_s <= 0:
            raise ValueError("stream_keepalive_s must be > 0")


__all__ = ["DEFAULT_KEEP_ALIVE_S", "GatewayConfig"]
