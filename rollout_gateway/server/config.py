"""Configuration of the reference rollout gateway server: settings, defaults, validation."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from rollout_gateway.server.http.intake import IntakeLimits

#: Uvicorn keep-alive (seconds). Must exceed the idle timeout of client connection pools
#: (httpx's default ``keepalive_expiry`` is 5 s, the OpenAI SDK's is the same): if the
#: server closed idle connections first, a client could send its next turn on a socket the
#: server is closing at that very moment and get a spurious connection reset.
DEFAULT_KEEP_ALIVE_S = 75

#: Turn budget of a rollout registered with ``max_turns: -1`` (no limit of its own).
DEFAULT_MAX_TURNS = 1000
#: Completion tokens a rollout may generate in total, over all its turns.
DEFAULT_MAX_TOTAL_COMPLETION_TOKENS = 4_000_000
#: Bytes of chat messages a rollout may make the gateway store (history is stored once;
#: a rollout that rewrites its history every turn pays for every copy).
DEFAULT_MAX_ROLLOUT_MESSAGE_BYTES = 64 * 1024 * 1024
#: Largest request body.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: Request bodies over 256 KiB parsed at once, gateway-wide (see ``http.intake``).
DEFAULT_MAX_CONCURRENT_PARSES = 2
#: Largest estimated parse cost (memory) of one request body, and of one rollout's
#: requests alive at once (see ``http.intake``): a 16 MiB body of chat text costs about
#: 140 MiB by the estimate, 16 MiB of ``[{}, ...]`` about 1 GiB.
DEFAULT_MAX_BODY_COST = 256 * 1024 * 1024
#: Request bodies being read or parsed at once, gateway-wide, at their size while read
#: and their estimated cost while parsed (see ``http.intake``).
DEFAULT_BODY_MEMORY = 1024 * 1024 * 1024
#: Share of the gateway's time one rollout's big bodies (over 256 KiB) may take to be
#: read, scanned, parsed and written again (the interpreter serves nobody else while it
#: parses). Low, as the kernel's copy of the bytes is not measured.
DEFAULT_ROLLOUT_PARSE_SHARE = 0.02
#: Exit streams open at once (one per env process; see ``server.control.exit_stream``).
DEFAULT_MAX_EXIT_STREAMS = 64
#: Messages in one chat request. Each costs work on the event loop every turn (the
#: history check, the stored copy); a long agent run has hundreds to a few thousand,
#: while 16 MiB of tiny ones (400k) stalled every other rollout for about 0.5 s a turn.
DEFAULT_MAX_MESSAGES = 8192


@dataclass
class GatewayConfig:
    """Settings of one gateway instance (see ``rollout-gateway serve --help``).

    Access:
        admin_token: register / cancel / unregister / trajectory / ``/metrics`` require
            ``Authorization: Bearer <admin_token>``. Required unless ``open_control_plane``.
        open_control_plane: run without an admin token (anyone who reaches the gateway
            drives every rollout). Only served on a loopback address.
        require_rollout_keys: register hands out a per-rollout ``api_key`` that chat
            requests must present as ``Authorization: Bearer`` (default on).

    Upstreams:
        upstreams: OpenAI base URLs of the inference servers (``http://h:p/v1``).
        upstream_timeout_s: total deadline of one upstream chat completion.
        upstream_connect_timeout_s: connect timeout to an upstream (fail fast when down).
        upstream_api_key: bearer token sent to the upstreams (e.g. vLLM ``--api-key``).
        probe_interval_s: period of the re-probe of unhealthy upstreams.
        stream_keepalive_s: a streaming agent gets an SSE keepalive comment after this
            many seconds without a chunk (tunnels and proxies drop silent connections).
        upstream_mode: ``"chat"`` (the engine renders each turn, ``/v1/chat/completions``)
            or ``"token-in"`` (the gateway renders and bridges with ``renderers`` and
            calls vLLM's ``/inference/v1/generate``; see :mod:`.engines.token_in`).
        tokenizer: token-in mode: the served model's tokenizer (HF model directory).
        renderer: token-in mode: ``auto``, a ``renderers`` renderer name, or
            ``module:factory`` (a callable taking the tokenizer).

    Per request and per rollout:
        max_body_bytes: largest accepted request body (413 beyond, checked from
            ``Content-Length`` and while reading).
        max_body_cost: largest estimated parse cost (bytes of memory) of one request
            body (413 ``request_too_complex`` beyond, before parsing); one rollout's
            requests alive at once hold at most this much together (more wait).
        body_memory: request bodies being read, waiting to be parsed, or parsed at once,
            gateway-wide, in bytes (at their size, then at their estimated cost): more
            wait before being read. Must hold ``max_concurrent_parses`` parses of
            ``max_body_cost`` plus one body of ``max_body_bytes``.
        max_concurrent_parses: request bodies over 256 KiB parsed at the same time,
            gateway-wide (each costs several times its size while parsed; more wait).
        rollout_parse_share: share of the gateway's time one rollout's bodies over
            256 KiB may take to be read, scanned, parsed and written again (in (0, 1]; 1:
            no wait). After one took ``t`` of CPU, that rollout's next one waits
            ``t * (1 / share - 1)`` before it is read.
        max_exit_streams: exit streams open at once, gateway-wide (one per env
            process; more are answered 429 and long-poll meanwhile).
        max_messages: messages in one chat request (400 ``too_many_messages`` beyond).
        default_max_turns: turn budget of rollouts registered without one (``-1``).
        max_total_completion_tokens: completion tokens per rollout, all turns together.
        default_max_context_tokens: context bound of rollouts registered without a
            ``max_seq_len`` (``None``: only the engine's own limit).
        max_rollout_message_bytes: message bytes stored per rollout.
        max_pending_turns: requests of one rollout queued or running at once (429 beyond).
        retry_dedupe_window_s: a request identical to the rollout's last answered one,
            arriving within this time, is answered from it instead of becoming a turn.

    Registry:
        enabled: when false, register answers 503 (the gateway is switched off).
        rollout_ttl_s: rollouts idle (no call) for longer than this are dropped.
        max_rollouts: registry bound; register answers 503 past it.
        sweep_interval_s: period of the idle-rollout sweep.

    State (see ``docs/state.md``):
        state_dir: keep the gateway's state in a SQLite database in this directory
            (durable across restarts; one gateway per directory). ``None``: in memory,
            lost with the process.
        state_sync: when a turn is on disk before its answer goes out: ``"normal"``
            (written to the database's log: survives the process being killed) or
            ``"full"`` (also flushed to the device: survives power loss).
        redis_url: keep the state in Redis, shared by every gateway given the same URL
            and prefix (several gateways behind a load balancer): ``redis://``,
            ``rediss://`` or ``unix://``. Not with ``state_dir``.
        redis_prefix: put before every key in Redis (deployments sharing one Redis).
        redis_lease_s: how long a gateway that died mid-turn holds up its rollout's
            next turn (a running turn renews its lease).

    Connections (enforced by the HTTP server, :mod:`rollout_gateway.server.http.connections`):
        header_timeout_s: a connection must send a request's headers within this time.
        body_timeout_s: ... and its whole body within this time after the headers.
        keep_alive_s: idle keep-alive connections are closed after this.
        max_connections: open connections at most (a new one beyond closes the one idle
            longest, or itself). ``None``: derived from the process's file-descriptor
            limit (``RLIMIT_NOFILE``), at most 4096; see
            :mod:`rollout_gateway.server.http.fds`. A number the limit cannot hold is
            refused when the server starts.
        max_connections_per_upstream: size of each upstream's HTTP connection pool (at
            most what the file-descriptor limit leaves for upstream connections).
    """

    upstreams: list[str] = field(default_factory=list)
    admin_token: str | None = None
    open_control_plane: bool = False
    require_rollout_keys: bool = True
    enabled: bool = True
    rollout_ttl_s: float = 3600.0
    max_rollouts: int = 10_000
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 5.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_body_cost: int = DEFAULT_MAX_BODY_COST
    body_memory: int = DEFAULT_BODY_MEMORY
    max_concurrent_parses: int = DEFAULT_MAX_CONCURRENT_PARSES
    rollout_parse_share: float = DEFAULT_ROLLOUT_PARSE_SHARE
    max_exit_streams: int = DEFAULT_MAX_EXIT_STREAMS
    max_messages: int = DEFAULT_MAX_MESSAGES
    sweep_interval_s: float = 30.0
    probe_interval_s: float = 5.0
    upstream_api_key: str | None = None
    max_connections_per_upstream: int = 1024
    default_max_turns: int = DEFAULT_MAX_TURNS
    max_total_completion_tokens: int = DEFAULT_MAX_TOTAL_COMPLETION_TOKENS
    default_max_context_tokens: int | None = None
    max_rollout_message_bytes: int = DEFAULT_MAX_ROLLOUT_MESSAGE_BYTES
    max_pending_turns: int = 4
    retry_dedupe_window_s: float = 120.0
    header_timeout_s: float = 30.0
    body_timeout_s: float = 120.0
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_connections: int | None = None
    stream_keepalive_s: float = 10.0
    upstream_mode: str = "chat"
    tokenizer: str | None = None
    renderer: str = "auto"
    state_dir: str | None = None
    state_sync: str = "normal"
    redis_url: str | None = None
    redis_prefix: str = "rg:"
    redis_lease_s: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_field(f.name, str(f.type), getattr(self, f.name))
        if not self.upstreams:
            raise ValueError("upstreams: at least one upstream base URL is required")
        self.upstreams = [u.strip().rstrip("/") for u in self.upstreams]
        for url in self.upstreams:
            parts = urlsplit(url)
            try:
                port_ok = parts.port is None or 0 < parts.port < 65536
            except ValueError:
                port_ok = False
            if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
                raise ValueError(f"upstreams: not an http(s) base URL: {url!r}")
        if self.upstream_mode not in ("chat", "token-in"):
            raise ValueError(f"upstream_mode: 'chat' or 'token-in', not {self.upstream_mode!r}")
        if self.state_sync not in ("normal", "full"):
            raise ValueError(f"state_sync: 'normal' or 'full', not {self.state_sync!r}")
        if self.state_dir is not None and not self.state_dir.strip():
            raise ValueError("state_dir: must not be empty")
        if self.redis_url is not None:
            if self.state_dir is not None:
                raise ValueError(
                    "redis_url and state_dir: choose one (Redis for several gateways, a "
                    "state directory for one)"
                )
            scheme = urlsplit(self.redis_url).scheme
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError(
                    f"redis_url: a redis://, rediss:// or unix:// URL, not {scheme or 'no'}://"
                )
        if not self.redis_prefix:
            raise ValueError("redis_prefix: must not be empty")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ValueError("admin_token: must not be empty")
        if self.admin_token is None and not self.open_control_plane:
            raise ValueError(
                "admin_token: required (or set open_control_plane=True explicitly, loopback only)"
            )
        for problem in self.contradictions():
            raise ValueError(problem)

    def contradictions(self) -> list[str]:
        """Settings that each look valid but cannot hold together (each message names
        the fields, and the ``serve`` options or variables that set them)."""
        out = []
        if self.open_control_plane and self.admin_token is not None:
            out.append(
                "open_control_plane (--open-control-plane): an admin token is configured too"
            )
        seen: set[str] = set()
        for url in self.upstreams:
            if url in seen:
                out.append(f"upstreams (--upstream): {_redacted(url)} is listed twice")
            seen.add(url)
        if self.upstream_api_key is not None:
            key = self.upstream_api_key
            if not key or not all("!" <= c <= "~" for c in key):
                out.append(
                    "upstream_api_key ($ROLLOUT_GATEWAY_UPSTREAM_API_KEY): must be printable "
                    "ASCII without spaces (it is sent as an HTTP header)"
                )
            with_credentials = [u for u in self.upstreams if _has_credentials(u)]
            if with_credentials:
                out.append(
                    f"upstreams (--upstream): {_redacted(with_credentials[0])} carries "
                    "credentials (user:password@) and upstream_api_key "
                    "($ROLLOUT_GATEWAY_UPSTREAM_API_KEY) is set too: an upstream request "
                    "cannot carry both; keep one"
                )
        if self.upstream_mode != "token-in":
            if self.tokenizer is not None:
                out.append("tokenizer (--tokenizer): only with upstream_mode 'token-in'")
            if self.renderer != "auto":
                out.append("renderer (--renderer): only with upstream_mode 'token-in'")
        out.extend(self.intake_limits().problems())
        return out

    def intake_limits(self) -> IntakeLimits:
        """The request-body bounds (see :mod:`rollout_gateway.server.http.intake`)."""
        return IntakeLimits(
            max_body_bytes=self.max_body_bytes,
            max_body_cost=self.max_body_cost,
            body_memory=self.body_memory,
            max_concurrent_parses=self.max_concurrent_parses,
            rollout_parse_share=self.rollout_parse_share,
        )


def _has_credentials(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.username or parts.password)


def _redacted(url: str) -> str:
    """``url`` without the credentials in it (messages may reach logs)."""
    parts = urlsplit(url)
    if not (parts.username or parts.password):
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"***@{host}").geturl()


def _check_field(name: str, kind: str, value: object) -> None:
    """One field by its annotation: flags are bools, texts strings, sizes and times
    positive finite numbers (an int where the annotation says so); a bool or a string is
    never a number."""
    if value is None and kind.endswith("| None"):
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name}: must be true or false, got {value!r}")
        return
    base = kind.split("|")[0].strip()
    if base == "str":
        if not isinstance(value, str):
            raise ValueError(f"{name}: must be a string, got {value!r}")
        return
    if base not in ("int", "float"):
        return
    allowed = int if base == "int" else int | float
    if isinstance(value, bool) or not isinstance(value, allowed):
        what = "an integer" if base == "int" else "a number"
        raise ValueError(f"{name}: must be {what}, got {value!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name}: must be a positive finite number, got {value!r}")


__all__ = [
    "DEFAULT_BODY_MEMORY",
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_BODY_COST",
    "DEFAULT_MAX_CONCURRENT_PARSES",
    "DEFAULT_MAX_EXIT_STREAMS",
    "DEFAULT_MAX_MESSAGES",
    "DEFAULT_MAX_ROLLOUT_MESSAGE_BYTES",
    "DEFAULT_MAX_TOTAL_COMPLETION_TOKENS",
    "DEFAULT_MAX_TURNS",
    "DEFAULT_ROLLOUT_PARSE_SHARE",
    "GatewayConfig",
]
