"""Configuration of the reference rollout gateway server: :class:`GatewayConfig`.

The settings are a few small value objects, one per concern (as httpx's ``Timeout`` and
``Limits``): :class:`UpstreamSettings`, :class:`RolloutLimits`,
:class:`~rollout_gateway.server.http.intake.IntakeLimits`, :class:`ConnectionSettings`,
:class:`RegistrySettings` and :class:`StateSettings`, under :class:`GatewayConfig` with
the settings every gateway names (its upstreams and its access rules).

Each setting is declared once, as a field made by :func:`rollout_gateway.options.option`:
its default, its check, its help and the ``serve`` flag (or variable) that sets it. The
command line is generated from these declarations, and a bad value raises
:class:`~rollout_gateway.options.ConfigError` naming the field and its flag.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rollout_gateway.options import (
    POSITIVE,
    POSITIVE_INT,
    ConfigError,
    base_url,
    base_url_problem,
    check_options,
    option,
    source_of,
)
from rollout_gateway.server.http.intake import (
    DEFAULT_BODY_MEMORY,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BODY_COST,
    DEFAULT_MAX_CONCURRENT_PARSES,
    DEFAULT_ROLLOUT_PARSE_SHARE,
    IntakeLimits,
)

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
#: Exit streams open at once (one per env process; see ``server.control.exit_stream``).
DEFAULT_MAX_EXIT_STREAMS = 64
#: Messages in one chat request. Each costs work on the event loop every turn (the
#: history check, the stored copy); a long agent run has hundreds to a few thousand,
#: while 16 MiB of tiny ones (400k) stalled every other rollout for about 0.5 s a turn.
DEFAULT_MAX_MESSAGES = 8192

UPSTREAM_API_KEY_ENV = "ROLLOUT_GATEWAY_UPSTREAM_API_KEY"
_TOKENS = "how turns are tokenized (see the docs: token-in mode)"


@dataclass(frozen=True)
class UpstreamSettings:
    """How the gateway calls its upstreams (the engines), and how turns are tokenized."""

    upstream_timeout_s: float = option(
        600.0, flag="--upstream-timeout", bound=POSITIVE, metavar="S",
        help="total deadline of one upstream completion",
    )  # fmt: skip
    upstream_connect_timeout_s: float = option(
        5.0, bound=POSITIVE, help="connect timeout to an upstream (fail fast when down)"
    )
    upstream_api_key: str | None = option(
        None, env=UPSTREAM_API_KEY_ENV,
        help="bearer token sent to the upstreams (e.g. vLLM --api-key); never a flag",
    )  # fmt: skip
    max_connections_per_upstream: int = option(
        1024, bound=POSITIVE_INT,
        help="size of each upstream's HTTP connection pool (at most what the "
        "file-descriptor limit leaves for upstream connections)",
    )  # fmt: skip
    probe_interval_s: float = option(
        1.0, flag="--probe-interval", bound=POSITIVE, metavar="S",
        help="period of the health probe of the upstreams (GET /models) and the state "
        "store; /health answers from its last result",
    )  # fmt: skip
    upstream_mode: str = option(
        "chat", flag="--upstream-mode", choices=("chat", "token-in"), group=_TOKENS,
        help="chat: the engine renders each turn (/v1/chat/completions); token-in: the "
        "gateway renders and bridges turns with the renderers package, as verifiers v1's "
        "TrainClient does, and calls vLLM's /inference/v1/generate (vLLM started with "
        "--enable-scale-out; needs rollout-gateway[tito])",
    )  # fmt: skip
    tokenizer: str | None = option(
        None, flag="--tokenizer", metavar="PATH", group=_TOKENS,
        help="token-in: the served model's tokenizer (HF model directory); default: the "
        "model path the upstream's /v1/models reports, when it is a local directory",
    )  # fmt: skip
    renderer: str = option(
        "auto", flag="--renderer", metavar="NAME", group=_TOKENS,
        help="token-in: a renderers renderer name (qwen3, glm5...), 'module:factory' (a "
        "callable taking the tokenizer), or auto",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_options(self)
        key = self.upstream_api_key
        if key is not None and (not key or not all("!" <= c <= "~" for c in key)):
            raise ConfigError(
                "upstream_api_key",
                f"${UPSTREAM_API_KEY_ENV}",
                "must be printable ASCII without spaces (it is sent as an HTTP header)",
            )
        if self.upstream_mode != "token-in":
            for name in ("tokenizer", "renderer"):
                if getattr(self, name) != _defaults(UpstreamSettings)[name]:
                    raise ConfigError(name, f"--{name}", "only with --upstream-mode token-in")


@dataclass(frozen=True)
class RolloutLimits:
    """What one rollout may use: turns, tokens, stored bytes, requests at once."""

    default_max_turns: int = option(
        DEFAULT_MAX_TURNS, flag="--max-turns", bound=POSITIVE_INT, metavar="N",
        help="turns of a rollout registered with max_turns=-1",
    )  # fmt: skip
    max_total_completion_tokens: int = option(
        DEFAULT_MAX_TOTAL_COMPLETION_TOKENS, flag="--max-completion-tokens",
        bound=POSITIVE_INT, metavar="N",
        help="completion tokens of a rollout, all turns together",
    )  # fmt: skip
    default_max_context_tokens: int | None = option(
        None, flag="--max-context-tokens", bound=POSITIVE_INT, metavar="N",
        default_text="none, the engine's own",
        help="context bound of a rollout registered without max_seq_len",
    )  # fmt: skip
    max_rollout_message_bytes: int = option(
        DEFAULT_MAX_ROLLOUT_MESSAGE_BYTES, flag="--max-rollout-bytes", bound=POSITIVE_INT,
        metavar="N", help="message bytes stored per rollout",
    )  # fmt: skip
    max_messages: int = option(
        DEFAULT_MAX_MESSAGES, flag="--max-messages", bound=POSITIVE_INT, metavar="N",
        help="messages in one chat request (400 too_many_messages beyond)",
    )  # fmt: skip
    max_pending_turns: int = option(
        4, bound=POSITIVE_INT, help="requests of one rollout queued or running at once (429 beyond)"
    )
    retry_dedupe_window_s: float = option(
        120.0, flag="--retry-window", bound=POSITIVE, metavar="S",
        help="an identical request this soon after a turn's answer is a retry",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class ConnectionSettings:
    """The HTTP server's connections (enforced by
    :mod:`rollout_gateway.server.http.connections`) and the agents' streams."""

    header_timeout_s: float = option(
        30.0, flag="--header-timeout", bound=POSITIVE, metavar="S",
        help="time to send a request's headers",
    )  # fmt: skip
    body_timeout_s: float = option(
        120.0, flag="--body-timeout", bound=POSITIVE, metavar="S",
        help="time to send a request's body after its headers",
    )  # fmt: skip
    keep_alive_s: float = option(
        float(DEFAULT_KEEP_ALIVE_S), flag="--keep-alive", bound=POSITIVE, metavar="S",
        help="idle keep-alive connections close after this",
    )  # fmt: skip
    max_connections: int | None = option(
        None, flag="--max-connections", bound=POSITIVE_INT, metavar="N",
        help="open connections at most; a new one closes the longest-idle connection (or "
        "itself, when all are busy with a request). Default: what the file-descriptor "
        "limit leaves (serve raises its soft limit to the hard one; 64 are reserved, a "
        "third of the rest goes to upstream connections), at most 4096; a number the "
        "limit cannot hold is refused",
    )  # fmt: skip
    max_exit_streams: int = option(
        DEFAULT_MAX_EXIT_STREAMS, flag="--max-exit-streams", bound=POSITIVE_INT, metavar="N",
        help="exit-report streams open at once, one per env process, at most half the "
        "connection cap; more get 429 and long-poll meanwhile",
    )  # fmt: skip
    stream_keepalive_s: float = option(
        10.0, bound=POSITIVE,
        help="a streaming agent gets an SSE keepalive comment after this many seconds "
        "without a chunk (tunnels and proxies drop silent connections)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class RegistrySettings:
    """How many rollouts are kept, and for how long."""

    rollout_ttl_s: float = option(
        3600.0, flag="--rollout-ttl", bound=POSITIVE, metavar="SECONDS",
        help="idle rollouts are dropped after this",
    )  # fmt: skip
    max_rollouts: int = option(
        10_000, flag="--max-rollouts", bound=POSITIVE_INT, metavar="N",
        help="registered rollouts at most (register answers 503 beyond)",
    )  # fmt: skip
    sweep_interval_s: float = option(30.0, bound=POSITIVE, help="period of the idle-rollout sweep")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class StateSettings:
    """Where the gateway keeps its state (``docs/state.md``): in memory (the default,
    lost with the process), in SQLite (``state_dir``) or in Redis (``redis_url``)."""

    state_dir: str | None = option(
        None, flag="--state-dir", metavar="DIR",
        help="keep rollouts, recorded turns, keys, limits, exit reports and the policy "
        "version in a SQLite database in DIR (created 0700; one gateway per directory): a "
        "gateway restarted on DIR, even after kill -9, goes on with every rollout, and a "
        "retry of a turn answered before the restart gets that answer. Unwritable, full, "
        "or written by another version: serve exits with status 2",
    )  # fmt: skip
    state_sync: str = option(
        "normal", flag="--state-sync", choices=("normal", "full"), requires="state_dir",
        help="with --state-dir, when a turn counts as stored before its answer is sent: "
        "normal = in the database's log (survives the gateway's process being killed), "
        "full = flushed to the device too (survives power loss; more latency per turn)",
    )  # fmt: skip
    redis_url: str | None = option(
        None, flag="--redis", metavar="URL",
        help="keep rollouts, recorded turns, keys, limits, exit reports and the policy "
        "version in Redis (redis://[user:password@]host:port/db, rediss:// or unix://), "
        "shared by every gateway given the same URL: run several behind a load balancer "
        "(round robin, no stickiness) and any request of any rollout may go to any of "
        "them. Needs the redis extra. Unreachable, or holding another version's state: "
        "serve exits with status 2",
    )  # fmt: skip
    redis_prefix: str = option(
        "rg:", flag="--redis-prefix", metavar="PREFIX", requires="redis_url",
        help="with --redis, put before every key (deployments sharing one Redis)",
    )  # fmt: skip
    redis_lease_s: float = option(
        10.0, flag="--redis-lease", bound=POSITIVE, metavar="SECONDS", requires="redis_url",
        help="with --redis, how long a gateway that died mid-turn holds up that "
        "rollout's next turn (a running turn renews it)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_options(self)
        if self.state_dir is not None and not self.state_dir.strip():
            raise ConfigError("state_dir", "--state-dir", "must not be empty")
        if not self.redis_prefix:
            raise ConfigError("redis_prefix", "--redis-prefix", "must not be empty")
        if self.redis_url is None:
            return
        if self.state_dir is not None:
            raise ConfigError(
                "redis_url and state_dir",
                "--redis and --state-dir",
                "choose one (Redis for several gateways, a state directory for one)",
            )
        scheme = urlsplit(self.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(
                "redis_url",
                "--redis",
                f"a redis://, rediss:// or unix:// URL, not {scheme or 'no'}://",
            )


_ACCESS = "access (see the security model below)"


@dataclass
class GatewayConfig:
    """Settings of one gateway instance (``rollout-gateway serve --help`` lists them).

    Its upstreams and access rules, and one small value object per concern; each field
    declares its default, check and help (:mod:`rollout_gateway.options`). A value that
    cannot be used raises :class:`~rollout_gateway.options.ConfigError` (a
    ``ValueError``) naming the field and the flag that sets it.
    :meth:`from_fields` builds one from flat field names (a config file, ``serve``).

    The admin token: register / cancel / unregister / trajectory / ``/metrics`` require
    ``Authorization: Bearer <admin_token>``; required unless ``open_control_plane``
    (anyone who reaches the gateway then drives every rollout: loopback only).
    """

    upstreams: list[str] = option(
        default_factory=list, flag="--upstream", convert=base_url, metavar="URL",
        required=True,
        help="OpenAI base URL of an upstream, e.g. http://127.0.0.1:8001/v1 (repeatable)",
    )  # fmt: skip
    admin_token: str | None = option(
        None, env="ROLLOUT_GATEWAY_ADMIN_TOKEN",
        help="the control plane's bearer token (serve: from the variable or a file, never "
        "a flag)",
    )  # fmt: skip
    open_control_plane: bool = option(
        False, flag="--open-control-plane", group=_ACCESS,
        help="run WITHOUT an admin token: anyone reaching the gateway drives every "
        "rollout; loopback --host only",
    )  # fmt: skip
    require_rollout_keys: bool = option(
        True, flag="--no-rollout-keys", group=_ACCESS,
        help="do not issue per-rollout api keys (any agent can then drive any rollout)",
    )  # fmt: skip
    enabled: bool = option(True, flag="--disabled", help="start disabled: register answers 503")
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    limits: RolloutLimits = field(default_factory=RolloutLimits)
    intake: IntakeLimits = field(default_factory=IntakeLimits)
    connections: ConnectionSettings = field(default_factory=ConnectionSettings)
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    state: StateSettings = field(default_factory=StateSettings)

    def __post_init__(self) -> None:
        check_options(self)
        for name, kind in _GROUPS.items():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(name, None, f"must be a {kind.__name__}")
        check_options(self.intake)
        if not self.upstreams:
            raise ConfigError(
                "upstreams", "--upstream", "at least one upstream base URL is required"
            )
        for url in self.upstreams:
            if base_url_problem(url) is not None:
                raise ConfigError("upstreams", "--upstream", f"not an http(s) base URL: {url!r}")
        self.upstreams = [u.strip().rstrip("/") for u in self.upstreams]
        if self.admin_token is not None and not self.admin_token.strip():
            raise ConfigError("admin_token", None, "must not be empty")
        if self.admin_token is None and not self.open_control_plane:
            raise ConfigError(
                "admin_token",
                None,
                "required (or set open_control_plane=True explicitly, loopback only)",
            )
        for problem in self.contradictions():
            raise problem

    @classmethod
    def from_fields(cls, **values: Any) -> GatewayConfig:
        """A config from flat field names, each routed to its value object
        (``GatewayConfig.from_fields(upstreams=[...], admin_token=..., max_messages=64)``);
        an unknown name is a ``TypeError``, as for the constructor."""
        groups: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
        own: dict[str, Any] = {}
        for name, value in values.items():
            group = _GROUP_OF.get(name)
            if group is None and name not in _OWN_FIELDS:
                raise TypeError(f"GatewayConfig has no setting {name!r}")
            (groups[group] if group is not None else own)[name] = value
        built = {name: kind(**groups[name]) for name, kind in _GROUPS.items() if groups[name]}
        return cls(**own, **built)

    def contradictions(self) -> list[ConfigError]:
        """Settings that each look valid but cannot hold together (each names the
        fields, and the ``serve`` options or variables that set them)."""
        out = []
        if self.open_control_plane and self.admin_token is not None:
            out.append(
                ConfigError(
                    "open_control_plane", "--open-control-plane", "an admin token is configured too"
                )
            )
        seen: set[str] = set()
        for url in self.upstreams:
            if url in seen:
                out.append(
                    ConfigError("upstreams", "--upstream", f"{_redacted(url)} is listed twice")
                )
            seen.add(url)
        with_credentials = [u for u in self.upstreams if _has_credentials(u)]
        if self.upstream.upstream_api_key is not None and with_credentials:
            out.append(
                ConfigError(
                    "upstreams",
                    "--upstream",
                    f"{_redacted(with_credentials[0])} carries credentials (user:password@) "
                    f"and upstream_api_key (${UPSTREAM_API_KEY_ENV}) is set too: an upstream "
                    "request cannot carry both; keep one",
                )
            )
        out.extend(ConfigError(None, None, p) for p in self.intake.problems())
        return out


#: The value objects of :class:`GatewayConfig`, by attribute.
_GROUPS: dict[str, type[Any]] = {
    "upstream": UpstreamSettings,
    "limits": RolloutLimits,
    "intake": IntakeLimits,
    "connections": ConnectionSettings,
    "registry": RegistrySettings,
    "state": StateSettings,
}
#: Each value object's field names, to the attribute holding it.
_GROUP_OF = {f.name: name for name, kind in _GROUPS.items() for f in dataclasses.fields(kind)}
_OWN_FIELDS = {f.name for f in dataclasses.fields(GatewayConfig)} - set(_GROUPS)


def _defaults(cls: type[Any]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


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
    "ConfigError",
    "ConnectionSettings",
    "GatewayConfig",
    "IntakeLimits",
    "RegistrySettings",
    "RolloutLimits",
    "StateSettings",
    "UpstreamSettings",
    "source_of",
]
