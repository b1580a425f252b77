"""The ``rollout-gateway`` command line.

Each subcommand is one function decorated with :func:`subcommand`: it receives the
subparsers object, adds its parser and sets ``func`` (the callable run with the parsed
arguments, returning an exit code). Adding a subcommand means adding one such function.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from rollout_gateway.server import GatewayConfig

SubcommandSetup = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

_SUBCOMMANDS: list[SubcommandSetup] = []


def subcommand(setup: SubcommandSetup) -> SubcommandSetup:
    """Register a function that adds one subcommand's parser (see the module docstring)."""
    _SUBCOMMANDS.append(setup)
    return setup


def _number(
    kind: type[int] | type[float], accept: Callable[[int | float], bool], what: str
) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` that ``accept`` takes, else "must be
    ``what``" (argparse names the option). NaN is refused by every bound."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a positive finite number of ``kind``."""
    return _number(kind, lambda v: 0 < v < math.inf, "a positive number")


#: A share of time: in (0, 1].
_share = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
#: A TCP port (uvicorn took 70000 and bound another port).
_port = _number(int, lambda v: 0 < v < 65536, "a port from 1 to 65535")
#: A finite number >= 0.
_non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")


#: ``--log-level`` values (case-insensitive); anything else failed later with a traceback.
LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="log level (default: %(default)s)",
    )


def _upstream_url(text: str) -> str:
    """An argparse type: an http(s) base URL with a host and a valid port."""
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise argparse.ArgumentTypeError(f"not an http(s) base URL: {text!r}")
    return text.strip()


class _RefuseOnCommandLine(argparse.Action):
    """Refuse a secret given as an argument (any user sees it in ``ps``)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.error(
            f"{self.option_strings[0]}: secrets are not accepted on the command line "
            f"(visible in ps); use {self.help_text}"
        )

    @property
    def help_text(self) -> str:
        return str(self.metavar)


_SERVE_EPILOG = """\
security model:
  The control plane (register, trajectory, cancel, unregister, /metrics, upstream
  details of /health) needs "Authorization: Bearer <admin token>". The token is read
  from $ROLLOUT_GATEWAY_ADMIN_TOKEN or from a file (--admin-token-file or
  $ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE), never from the command line (it would show in ps),
  and has at least 16 characters. --create-admin-token writes a fresh one to that file
  (mode 0600) when it does not exist; the env reads the same file through
  $ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE. Without a token, serve refuses to start unless
  --open-control-plane is given, which only binds to a loopback address.
  Register hands out a per-rollout api_key (on by default, --no-rollout-keys to turn
  off): an agent presents it as its bearer token and reaches only its own rollout, on
  /v1/rollouts/{id}/chat/completions or on /v1/chat/completions (routed by the key).
  Agents get short error messages; upstream URLs and tracebacks go to the log only.

what an agent may set:
  forwarded: messages, tools, tool_choice, parallel_tool_calls, response_format, stop.
  read: max_tokens / max_completion_tokens (used only if registration sets none),
  stream, stream_options, logprobs, return_token_ids (shape the answer); model and
  top_logprobs are ignored.
  Every other field (temperature, top_p, top_k, n, seed, logit_bias, ...) is dropped,
  never rejected; the turn's extras list the dropped names. The registered
  sampling_params are what the engine gets.

refused turns:
  a turn past a rollout's budget, or of a cancelled/completed rollout, is answered
  403 (not retried by OpenAI SDKs, unlike 409) with error.code naming the reason
  (max_turns_reached, max_completion_tokens_reached, max_context_reached,
  max_rollout_bytes_reached, rollout_cancelled, rollout_completed); the trajectory
  then has is_truncated=true and truncation_reason. A retry (same Idempotency-Key, or
  the same body while the turn runs or within --retry-window of its answer) gets the
  turn's answer and is not a new turn.
"""


@subcommand
def add_serve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``rollout-gateway serve``: the reference rollout gateway."""
    p = subparsers.add_parser(
        "serve",
        help="run the rollout gateway in front of OpenAI-compatible upstreams",
        description="Run the rollout gateway (protocol v1) in front of one or more "
        "OpenAI-compatible upstreams (vLLM, the scripted model...).",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=None,
    )
    p.add_argument(
        "--upstream",
        action="append",
        required=True,
        type=_upstream_url,
        metavar="URL",
        help="OpenAI base URL of an upstream, e.g. http://127.0.0.1:8001/v1 (repeatable)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=_port, default=8000, help="port to listen on (default: %(default)s)"
    )
    _add_access_options(p)
    p.add_argument(
        "--upstream-api-key",
        action=_RefuseOnCommandLine,
        metavar="$ROLLOUT_GATEWAY_UPSTREAM_API_KEY",
        help=argparse.SUPPRESS,  # refused: a key on the command line shows in ps
    )
    _add_token_options(p)
    _add_limit_options(p)
    _add_connection_options(p)
    _add_registry_options(p)
    _add_state_options(p)
    p.add_argument("--disabled", action="store_true", help="start disabled: register answers 503")
    _add_log_level(p)
    p.set_defaults(func=run_serve)


def _add_access_options(p: argparse.ArgumentParser) -> None:
    """``serve``: who may drive the gateway (admin token, per-rollout keys)."""
    access = p.add_argument_group("access (see the security model below)")
    access.add_argument(
        "--admin-token-file",
        metavar="PATH",
        help="file holding the control-plane admin token "
        "(default: $ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE, else $ROLLOUT_GATEWAY_ADMIN_TOKEN)",
    )
    access.add_argument(
        "--create-admin-token",
        action="store_true",
        help="write a fresh admin token to --admin-token-file (mode 0600) when that file "
        "does not exist, and say where it is; hand the env the same file with "
        "$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE",
    )
    access.add_argument(
        "--open-control-plane",
        action="store_true",
        help="run WITHOUT an admin token: anyone reaching the gateway drives every "
        "rollout; loopback --host only",
    )
    access.add_argument(
        "--admin-token",
        action=_RefuseOnCommandLine,
        metavar="$ROLLOUT_GATEWAY_ADMIN_TOKEN or --admin-token-file",
        help=argparse.SUPPRESS,  # refused: a token on the command line shows in ps
    )
    access.add_argument(
        "--require-rollout-keys",
        action="store_true",
        help=argparse.SUPPRESS,  # the default now; accepted for old command lines
    )
    access.add_argument(
        "--no-rollout-keys",
        dest="rollout_keys",
        action="store_false",
        help="do not issue per-rollout api keys (any agent can then drive any rollout)",
    )


def _add_token_options(p: argparse.ArgumentParser) -> None:
    """``serve``: how turns are tokenized (chat or token-in mode)."""
    tokens = p.add_argument_group("how turns are tokenized (see the docs: token-in mode)")
    tokens.add_argument(
        "--upstream-mode",
        choices=("chat", "token-in"),
        default="chat",
        help="chat: the engine renders each turn (/v1/chat/completions); token-in: the "
        "gateway renders and bridges turns with the renderers package, as verifiers v1's "
        "TrainClient does, and calls vLLM's /inference/v1/generate (vLLM started with "
        "--enable-scale-out; needs rollout-gateway[tito]) (default: %(default)s)",
    )
    tokens.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="token-in: the served model's tokenizer (HF model directory); default: the "
        "model path the upstream's /v1/models reports, when it is a local directory",
    )
    tokens.add_argument(
        "--renderer",
        default="auto",
        metavar="NAME",
        help="token-in: a renderers renderer name (qwen3, glm5...), 'module:factory' (a "
        "callable taking the tokenizer), or auto (default: %(default)s)",
    )


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    """``serve``: limits per request and per rollout."""
    from rollout_gateway.server import config as defaults

    positive_int, positive_float = _positive(int), _positive(float)
    limits = p.add_argument_group("limits per request and per rollout")
    limits.add_argument(
        "--max-body-bytes", type=positive_int, default=defaults.DEFAULT_MAX_BODY_BYTES,
        metavar="N", help="largest request body (413 beyond; default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-body-cost", type=positive_int, default=defaults.DEFAULT_MAX_BODY_COST,
        metavar="BYTES",
        help="largest estimated parse cost of a request body: its size plus 96 bytes per "
        "',' '[' '{' in it (413 request_too_complex beyond, before parsing); one rollout's "
        "requests alive at once hold at most this much together, more wait "
        "(default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--body-memory", type=positive_int, default=defaults.DEFAULT_BODY_MEMORY,
        metavar="BYTES",
        help="request bodies being read or parsed at once, gateway-wide (at their size, "
        "then at their parse cost); more wait before being read; must hold "
        "--max-concurrent-parses x --max-body-cost + --max-body-bytes "
        "(default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-concurrent-parses", type=positive_int,
        default=defaults.DEFAULT_MAX_CONCURRENT_PARSES, metavar="N",
        help="request bodies over 256 KiB parsed at once, gateway-wide; more wait their "
        "turn (bounds the memory of many big bodies at once; default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--rollout-parse-share", type=_share, default=defaults.DEFAULT_ROLLOUT_PARSE_SHARE,
        metavar="F",
        help="share of the gateway's time one rollout's bodies over 256 KiB may take (read, "
        "scanned, parsed, written again): after one took t of CPU, its next one waits "
        "t x (1/F - 1) before it is read; in (0, 1], 1 turns the wait off "
        "(default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-messages", type=positive_int, default=defaults.DEFAULT_MAX_MESSAGES,
        metavar="N",
        help="messages in one chat request (400 too_many_messages beyond; default: "
        "%(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-exit-streams", type=positive_int,
        default=defaults.DEFAULT_MAX_EXIT_STREAMS, metavar="N",
        help="exit-report streams open at once, one per env process, at most half the "
        "connection cap; more get 429 and long-poll meanwhile (default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-turns", type=positive_int, default=defaults.DEFAULT_MAX_TURNS, metavar="N",
        help="turns of a rollout registered with max_turns=-1 (default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-completion-tokens", type=positive_int,
        default=defaults.DEFAULT_MAX_TOTAL_COMPLETION_TOKENS, metavar="N",
        help="completion tokens of a rollout, all turns together (default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--max-context-tokens", type=positive_int, default=None, metavar="N",
        help="context bound of a rollout registered without max_seq_len "
        "(default: none, the engine's own)",
    )  # fmt: skip
    limits.add_argument(
        "--max-rollout-bytes", type=positive_int,
        default=defaults.DEFAULT_MAX_ROLLOUT_MESSAGE_BYTES, metavar="N",
        help="message bytes stored per rollout (default: %(default)s)",
    )  # fmt: skip
    limits.add_argument(
        "--retry-window", type=positive_float, default=120.0, metavar="S",
        help="an identical request this soon after a turn's answer is a retry "
        "(default: %(default)s)",
    )  # fmt: skip


def _add_connection_options(p: argparse.ArgumentParser) -> None:
    """``serve``: connections, timeouts, upstream client and event loop."""
    from rollout_gateway.server import config as defaults

    positive_int, positive_float = _positive(int), _positive(float)
    conns = p.add_argument_group("connections and time")
    conns.add_argument(
        "--header-timeout", type=positive_float, default=30.0, metavar="S",
        help="time to send a request's headers (default: %(default)s)",
    )  # fmt: skip
    conns.add_argument(
        "--body-timeout", type=positive_float, default=120.0, metavar="S",
        help="time to send a request's body after its headers (default: %(default)s)",
    )  # fmt: skip
    conns.add_argument(
        "--keep-alive", type=positive_float, default=float(defaults.DEFAULT_KEEP_ALIVE_S),
        metavar="S", help="idle keep-alive connections close after this (default: %(default)s)",
    )  # fmt: skip
    conns.add_argument(
        "--max-connections", type=positive_int, default=None, metavar="N",
        help="open connections at most; a new one closes the longest-idle connection (or "
        "itself, when all are busy with a request). Default: what the file-descriptor "
        "limit leaves (serve raises its soft limit to the hard one; 64 are reserved, a "
        "third of the rest goes to upstream connections), at most 4096; a number the "
        "limit cannot hold is refused",
    )  # fmt: skip
    conns.add_argument(
        "--upstream-timeout", type=positive_float, default=600.0, metavar="S",
        help="total deadline of one upstream completion (default: %(default)s)",
    )  # fmt: skip
    conns.add_argument(
        "--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
        help="event loop (default: %(default)s = uvloop when installed, it is a "
        "dependency; asyncio: the standard library's)",
    )  # fmt: skip


def _add_registry_options(p: argparse.ArgumentParser) -> None:
    """``serve``: how many rollouts are kept, and how long."""
    positive_int, positive_float = _positive(int), _positive(float)
    registry = p.add_argument_group("registry")
    registry.add_argument(
        "--rollout-ttl", type=positive_float, default=3600.0, metavar="SECONDS",
        help="idle rollouts are dropped after this (default: %(default)s)",
    )  # fmt: skip
    registry.add_argument(
        "--max-rollouts", type=positive_int, default=10_000, metavar="N",
        help="registered rollouts at most (default: %(default)s)",
    )  # fmt: skip


def _add_state_options(p: argparse.ArgumentParser) -> None:
    """``serve``: where the gateway keeps its state (see docs/state.md)."""
    state = p.add_argument_group(
        "state (default: in memory, lost with the process; see docs/state.md)"
    )
    state.add_argument(
        "--state-dir", metavar="DIR",
        help="keep rollouts, recorded turns, keys, limits, exit reports and the policy "
        "version in a SQLite database in DIR (created 0700; one gateway per directory): a "
        "gateway restarted on DIR, even after kill -9, goes on with every rollout, and a "
        "retry of a turn answered before the restart gets that answer. Unwritable, full, "
        "or written by another version: serve exits with status 2",
    )  # fmt: skip
    state.add_argument(
        "--state-sync", choices=("normal", "full"), default=None,
        help="with --state-dir, when a turn counts as stored before its answer is sent: "
        "normal = in the database's log (survives the gateway's process being killed), "
        "full = flushed to the device too (survives power loss; more latency per turn) "
        "(default: normal)",
    )  # fmt: skip
    state.add_argument(
        "--redis", metavar="URL",
        help="keep rollouts, recorded turns, keys, limits, exit reports and the policy "
        "version in Redis (redis://[user:password@]host:port/db, rediss:// or unix://), "
        "shared by every gateway given the same URL: run several behind a load balancer "
        "(round robin, no stickiness) and any request of any rollout may go to any of "
        "them. Needs the redis extra. Unreachable, or holding another version's state: "
        "serve exits with status 2",
    )  # fmt: skip
    state.add_argument(
        "--redis-prefix", default=None, metavar="PREFIX",
        help="with --redis, put before every key (deployments sharing one Redis; "
        "default: rg:)",
    )  # fmt: skip
    state.add_argument(
        "--redis-lease", type=_positive(float), default=None, metavar="SECONDS",
        help="with --redis, how long a gateway that died mid-turn holds up that "
        "rollout's next turn (a running turn renews it; default: 10)",
    )  # fmt: skip


def prepare_admin_token_file(args: argparse.Namespace) -> str | None:
    """Create the admin token file for ``--create-admin-token``; what to tell the user.

    Sets ``args.admin_token_file`` to the file used. Raises :class:`ServeOptionError`
    naming the option when no file is named or it cannot be created.
    """
    from rollout_gateway.admin_token import (
        ADMIN_TOKEN_FILE_ENV,
        AdminTokenFileError,
        create_admin_token_file,
        readable_by_others,
    )

    path = args.admin_token_file or os.environ.get(ADMIN_TOKEN_FILE_ENV) or None
    if not args.create_admin_token:
        if path and readable_by_others(path):
            return f"warning: the admin token file {path} is readable by other users"
        return None
    if path is None:
        raise ServeOptionError(
            "--create-admin-token: name the file to write with --admin-token-file PATH "
            f"(or ${ADMIN_TOKEN_FILE_ENV})"
        )
    try:
        created = create_admin_token_file(path)
    except AdminTokenFileError as e:
        raise ServeOptionError(f"--create-admin-token: {e}") from None
    args.admin_token_file = path = os.path.abspath(os.path.expanduser(path))
    hand_over = f"give the env the same token with {ADMIN_TOKEN_FILE_ENV}={path}"
    if created:
        return f"admin token written to {path} (mode 0600); {hand_over}"
    note = f"admin token read from {path} (it exists: kept); {hand_over}"
    if readable_by_others(path):
        note += f"\nwarning: the admin token file {path} is readable by other users"
    return note


def serve_config(args: argparse.Namespace) -> GatewayConfig:
    """The :class:`GatewayConfig` of parsed ``serve`` arguments.

    Raises :class:`ServeOptionError` naming the option when the options do not hold
    together (no admin token, open mode on a non-loopback host, unreadable token file).
    """
    from rollout_gateway.server import GatewayConfig
    from rollout_gateway.server.http.auth import AdminTokenError, is_loopback_host, load_admin_token

    try:
        token = load_admin_token(args.admin_token_file)
    except AdminTokenError as e:
        raise ServeOptionError(f"--admin-token-file / $ROLLOUT_GATEWAY_ADMIN_TOKEN: {e}") from None
    if args.open_control_plane:
        if token is not None:
            raise ServeOptionError("--open-control-plane: an admin token is configured too")
        if not is_loopback_host(args.host):
            raise ServeOptionError(
                f"--open-control-plane: only on a loopback --host, not {args.host!r}"
            )
    elif token is None:
        raise ServeOptionError(
            "no admin token: set $ROLLOUT_GATEWAY_ADMIN_TOKEN or --admin-token-file "
            "(or --open-control-plane on loopback, for local use)"
        )
    redis_url = getattr(args, "redis", None)
    redis_prefix, redis_lease = (
        getattr(args, "redis_prefix", None),
        getattr(args, "redis_lease", None),
    )
    for option, value in (("--redis-prefix", redis_prefix), ("--redis-lease", redis_lease)):
        if value is not None and redis_url is None:
            raise ServeOptionError(f"{option}: only with --redis")
    if redis_url is not None:
        if getattr(args, "state_dir", None) is not None:
            raise ServeOptionError(
                "--redis and --state-dir: choose one (Redis for several gateways, a state "
                "directory for one)"
            )
        scheme = urlsplit(redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ServeOptionError(
                f"--redis: a redis://, rediss:// or unix:// URL, not {scheme or 'no'}://"
            )
    tokenizer = getattr(args, "tokenizer", None)
    mode = getattr(args, "upstream_mode", "chat")
    if mode != "token-in" and tokenizer is not None:
        raise ServeOptionError("--tokenizer: only with --upstream-mode token-in")
    if mode != "token-in" and getattr(args, "renderer", "auto") != "auto":
        raise ServeOptionError("--renderer: only with --upstream-mode token-in")
    for url in args.upstream:
        if _is_own_address(url, args.host, args.port):
            raise ServeOptionError(
                f"--upstream {url}: that is this gateway's own address (--host {args.host} "
                f"--port {args.port}); every turn would call the gateway again"
            )
    if mode == "token-in" and tokenizer is None:
        tokenizer = served_model_path(args.upstream[0])
        if tokenizer is None:
            raise ServeOptionError(
                "--tokenizer: required with --upstream-mode token-in (the upstream's "
                "/v1/models names no local model directory)"
            )
    state_dir, state_sync = getattr(args, "state_dir", None), getattr(args, "state_sync", None)
    if state_sync is not None and state_dir is None:
        raise ServeOptionError("--state-sync: only with --state-dir (memory state is never synced)")
    return GatewayConfig(
        upstream_mode=mode,
        tokenizer=tokenizer,
        renderer=getattr(args, "renderer", "auto"),
        upstreams=args.upstream,
        enabled=not args.disabled,
        admin_token=token,
        open_control_plane=args.open_control_plane,
        require_rollout_keys=args.rollout_keys,
        rollout_ttl_s=args.rollout_ttl,
        max_rollouts=args.max_rollouts,
        upstream_timeout_s=args.upstream_timeout,
        max_body_bytes=args.max_body_bytes,
        max_body_cost=args.max_body_cost,
        body_memory=args.body_memory,
        max_concurrent_parses=args.max_concurrent_parses,
        rollout_parse_share=args.rollout_parse_share,
        max_exit_streams=args.max_exit_streams,
        max_messages=args.max_messages,
        upstream_api_key=os.environ.get("ROLLOUT_GATEWAY_UPSTREAM_API_KEY") or None,
        default_max_turns=args.max_turns,
        max_total_completion_tokens=args.max_completion_tokens,
        default_max_context_tokens=args.max_context_tokens,
        max_rollout_message_bytes=args.max_rollout_bytes,
        retry_dedupe_window_s=args.retry_window,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_s=args.keep_alive,
        max_connections=args.max_connections,
        state_dir=state_dir,
        state_sync=state_sync or "normal",
        redis_url=redis_url,
        redis_prefix=redis_prefix or "rg:",
        redis_lease_s=redis_lease or 10.0,
    )


class ServeOptionError(ValueError):
    """``serve`` options that cannot run (the message names the option)."""


#: Addresses a gateway listening on all interfaces answers on (as an upstream's host).
_THIS_MACHINE = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")


def _is_own_address(upstream: str, host: str, port: int) -> bool:
    """Whether ``upstream`` points at the gateway itself (``host``:``port``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(upstream)
    try:
        upstream_port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    if upstream_port != port:
        return False
    target = (parts.hostname or "").lower()
    listen = host.strip("[]").lower()
    if target == listen:
        return True
    # Listening on every interface (or on loopback): this machine's names reach it.
    return listen in ("0.0.0.0", "::", "localhost", "127.0.0.1", "::1") and target in _THIS_MACHINE


def served_model_path(upstream: str, timeout_s: float = 10.0) -> str | None:
    """The local directory the upstream serves its model from (vLLM's model card
    ``root``), or ``None`` when it does not answer or names no local directory."""
    import httpx

    try:
        listing = httpx.get(f"{upstream.rstrip('/')}/models", timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return None
    for card in listing.get("data") or [] if isinstance(listing, dict) else []:
        root = card.get("root") if isinstance(card, dict) else None
        if isinstance(root, str) and os.path.isdir(root):
            return root
    return None


def run_serve(args: argparse.Namespace) -> int:
    """Run ``serve`` with parsed arguments (exit code 2 on invalid options)."""
    import asyncio

    from rollout_gateway.server import create_app, serve
    from rollout_gateway.server.engines.token_in import TokenInUnavailable
    from rollout_gateway.server.http.fds import raise_fd_limit
    from rollout_gateway.server.ops.gc_tuning import tune_for_serving
    from rollout_gateway.server.state.backends import store_for
    from rollout_gateway.server.state.store import StoreError

    # This process only serves: as many connections as the hard limit allows.
    raise_fd_limit()
    try:
        notice = prepare_admin_token_file(args)
        config = serve_config(args)
    except ValueError as e:  # ServeOptionError, or GatewayConfig's own checks
        print(f"rollout-gateway serve: error: {e}", file=sys.stderr)
        return 2
    for line in (notice or "").splitlines():
        print(f"rollout-gateway serve: {line}", file=sys.stderr, flush=True)
    _setup_logging(args.log_level)
    try:
        store = store_for(config)
        # Opened before serving: a store that cannot be used is refused here, with its
        # reason, instead of a gateway that starts and fails its first turn.
        asyncio.run(store.open())
    except StoreError as e:
        option = "--redis" if config.redis_url is not None else "--state-dir"
        print(f"rollout-gateway serve: error: {option}: {e}", file=sys.stderr)
        return 2
    try:
        app = create_app(config, store=store)
    except (TokenInUnavailable, ValueError) as e:  # the message names the option
        # ValueError: what the process's limits cannot hold (--max-connections).
        print(f"rollout-gateway serve: error: {e}", file=sys.stderr)
        return 2
    tune_for_serving()  # this process only serves: see server/ops/gc_tuning.py
    serve(app, host=args.host, port=args.port, log_level=args.log_level, loop=args.loop)
    return 0


@subcommand
def add_scripted_model_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``rollout-gateway scripted-model``: the deterministic scripted upstream."""
    p = subparsers.add_parser(
        "scripted-model",
        help="run the scripted OpenAI-compatible model (base URL http://HOST:PORT/v1)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=_port, default=8001, help="port to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--latency-ms",
        type=_non_negative_float,
        default=0.0,
        help="added latency per completion (default: %(default)s)",
    )
    p.add_argument(
        "--model-name", default="scripted", help="model name it answers to (default: %(default)s)"
    )
    p.add_argument(
        "--max-model-len",
        type=_positive(int),
        default=None,
        metavar="N",
        help="refuse prompts of N tokens or more as vLLM does, 400 (default: no limit)",
    )
    p.add_argument(
        "--bytes-per-token",
        type=_positive(int),
        default=1,
        metavar="N",
        help="1: one token per byte (default); N: text in chunks of N bytes, one id each in a "
        "real vocabulary's range (a real tokenizer's bytes per token, for benchmarks)",
    )
    _add_log_level(p)
    p.set_defaults(func=run_scripted_model)


def run_scripted_model(args: argparse.Namespace) -> int:
    """Run ``scripted-model`` with parsed arguments."""
    from rollout_gateway.scripted import create_scripted_model_app
    from rollout_gateway.server import serve

    _setup_logging(args.log_level)
    app = create_scripted_model_app(
        model_name=args.model_name,
        latency_ms=args.latency_ms,
        max_model_len=args.max_model_len,
        bytes_per_token=args.bytes_per_token,
    )
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _demo_help_formatter() -> type[argparse.HelpFormatter]:
    from rollout_gateway.demo.options import DemoHelpFormatter

    class DemoHelp(DemoHelpFormatter):
        """Help of ``demo``, for the installed verifiers stack: its description and run
        directory layout, and which sandbox isolation this host offers (probed only when
        help is shown: probing starts processes)."""

        def _format_text(self, text: str) -> str:
            from rollout_gateway.demo.options import STACK_HELP
            from rollout_gateway.verifiers_stack import installed_stack

            description, layout = STACK_HELP[installed_stack() or "classic"]
            width = max(self._width - self._current_indent, 40)
            if text == _DEMO_DESCRIPTION:
                text = textwrap.fill(description, width)
            elif text == _DEMO_EPILOG:
                text = f"{_isolation_help()}\n\n{textwrap.fill(layout, width)}"
            return super()._format_text(text)

    return DemoHelp


_DEMO_DESCRIPTION = "{description}"
_DEMO_EPILOG = "{epilog}"


def _isolation_help() -> str:
    from rollout_gateway.local_sandbox import FALLBACK_ORDER, tools, unavailable_reasons
    from rollout_gateway.local_sandbox.limits import enforcement

    reasons = unavailable_reasons()
    lines = ["local sandbox isolation (strongest first; auto takes the first available):"]
    for mode in FALLBACK_ORDER:
        state = "available" if reasons[mode] is None else reasons[mode]
        program = tools.bwrap()
        if mode.value == "bwrap" and reasons[mode] is None and program is not None:
            state = f"available ({program.source} bwrap)"
        lines.append(f"  {mode:<14}{state}")
    lines.append("  process-group no containment: only with --isolation process-group")
    offered = [m for m in FALLBACK_ORDER if reasons[m] is None]
    uid = offered[0].uses_sandbox_uid if offered else False
    lines.append("limits each sandbox gets on this host (in the mode auto takes):")
    for kind, how in enforcement(uid).items():
        lines.append(f"  {kind:<14}{how}")
    return "\n".join(lines)


#: ``demo`` on an install without a verifiers stack (``pip install rollout-gateway``).
DEMO_NEEDS_A_STACK = (
    "the demo runs an example env of verifiers, which this install lacks (core only: the "
    "gateway server and the scripted model). Install a verifiers stack: pip install "
    "'rollout-gateway[v1]' (verifiers 0.4) or 'rollout-gateway[classic]' (verifiers 0.3), "
    "in separate virtualenvs"
)


def _add_demo_needs_a_stack(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``demo`` where no verifiers stack is installed: its help and its run say which
    extra it needs; nothing is probed, imported or created."""
    p = subparsers.add_parser(
        "demo",
        help="run the example env end to end on this machine (needs a verifiers extra)",
        description=f"Run the example env end to end on this machine: {DEMO_NEEDS_A_STACK}.",
    )

    def refuse(args: argparse.Namespace) -> int:
        print(f"rollout-gateway demo: error: {DEMO_NEEDS_A_STACK}", file=sys.stderr)
        return 2

    # Any demo option is taken (and ignored): the missing extra is the error to report.
    p.set_defaults(func=refuse, takes_any_options=True)


@subcommand
def add_demo_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``rollout-gateway demo``: the whole system on one machine (the installed stack)."""
    from rollout_gateway.verifiers_stack import installed_stack

    if installed_stack() is None:
        _add_demo_needs_a_stack(subparsers)
        return
    from rollout_gateway.demo import add_demo_arguments

    p = subparsers.add_parser(
        "demo",
        help="run the example env end to end on this machine (on the installed verifiers)",
        description=_DEMO_DESCRIPTION,
        epilog=_DEMO_EPILOG,
    )
    add_demo_arguments(p)
    p.formatter_class = _demo_help_formatter()
    p.set_defaults(func=run_demo_command, command_parser=p)


def run_demo_command(args: argparse.Namespace) -> int:
    """Run ``demo`` with parsed arguments (exit code 2, one line, on invalid options)."""
    from rollout_gateway.demo import DemoError, options_from_args, run_demo
    from rollout_gateway.demo.stack import exit_if_work_abandoned, off_loop_threads

    try:
        options = options_from_args(args)
    except DemoError as e:
        print(f"rollout-gateway demo: error: {e}", file=sys.stderr)
        return 2
    before = off_loop_threads()
    code = run_demo(options)
    exit_if_work_abandoned(code, before)  # a stop during setup: don't wait for the import
    return code


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("rollout-gateway")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    # httpx logs every upstream request at INFO; the gateway's own turn line says more.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def build_parser() -> argparse.ArgumentParser:
    """The full parser, one subparser per registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="rollout-gateway",
        description="The rollout-gateway command line: serve the gateway, a scripted model, "
        "or run the demo.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="show the version"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for setup in _SUBCOMMANDS:
        setup(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-gateway`` command."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any_options", False):
        # Reported by the subcommand's parser (``demo``'s: one line).
        command_parser = getattr(args, "command_parser", None) or parser
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
