"""``rollout-gateway serve``: its command line, generated from the gateway's settings.

The flags of :class:`~rollout_gateway.server.GatewayConfig` and its value objects come
from their declarations (:mod:`rollout_gateway.options`); :class:`ServeProcess` declares
the few that are the process's, not the gateway's (where to listen, the event loop, the
log level, the admin token file). :func:`serve_config` turns parsed arguments into a
config; everything it refuses is a :class:`ServeOptionError` naming the option.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_gateway.options import (
    PORT,
    ConfigError,
    add_options,
    option,
    typed_options,
    unmet_requirements,
    values_from,
)

if TYPE_CHECKING:
    from rollout_gateway.server import GatewayConfig

#: ``--log-level`` values (case-insensitive); anything else failed later with a traceback.
LOG_LEVELS = ("debug", "info", "warning", "error")
_ACCESS = "access (see the security model below)"
_CONNECTIONS = "connections and time"


def log_level_option() -> Any:
    """The ``--log-level`` field of a command's options."""
    return option(
        "info", flag="--log-level", convert=str.lower, choices=LOG_LEVELS, help="log level"
    )


@dataclass(frozen=True)
class ServeProcess:
    """What ``serve`` takes besides the gateway's settings."""

    host: str = option("127.0.0.1", flag="--host", help="address to listen on")
    port: int = option(8000, flag="--port", bound=PORT, help="port to listen on")
    admin_token_file: str | None = option(
        None, flag="--admin-token-file", metavar="PATH", group=_ACCESS,
        default_text="$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE, else $ROLLOUT_GATEWAY_ADMIN_TOKEN",
        help="file holding the control-plane admin token",
    )  # fmt: skip
    create_admin_token: bool = option(
        False, flag="--create-admin-token", group=_ACCESS,
        help="write a fresh admin token to --admin-token-file (mode 0600) when that file "
        "does not exist, and say where it is; hand the env the same file with "
        "$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE",
    )  # fmt: skip
    loop: str = option(
        "auto", flag="--loop", choices=("auto", "uvloop", "asyncio"), group=_CONNECTIONS,
        help="event loop (auto = uvloop when installed, it is a dependency; asyncio: the "
        "standard library's)",
    )  # fmt: skip
    log_level: str = log_level_option()


class ServeOptionError(ValueError):
    """``serve`` options that cannot run (the message names the option)."""


class RefuseOnCommandLine(argparse.Action):
    """Refuse a secret given as an argument (any user sees it in ``ps``)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.error(
            f"{self.option_strings[0]}: secrets are not accepted on the command line "
            f"(visible in ps); use {self.metavar}"
        )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``serve`` flag: generated from the settings' declarations, plus the refused
    secrets and an old flag still accepted."""
    from rollout_gateway.server import config

    add_options(p, config.GatewayConfig)
    access = next(g for g in p._action_groups if g.title == _ACCESS)
    for flag, where in (
        ("--admin-token", "$ROLLOUT_GATEWAY_ADMIN_TOKEN or --admin-token-file"),
        ("--upstream-api-key", f"${config.UPSTREAM_API_KEY_ENV}"),
    ):
        # refused: a secret on the command line shows in ps
        access.add_argument(flag, action=RefuseOnCommandLine, metavar=where, help=argparse.SUPPRESS)
    # The default now; accepted for old command lines.
    access.add_argument(
        "--require-rollout-keys", dest="old_require_rollout_keys", action="store_true",
        help=argparse.SUPPRESS,
    )  # fmt: skip
    add_options(p, config.UpstreamSettings, "upstreams")
    add_options(p, config.RolloutLimits, "limits per request and per rollout")
    add_options(p, config.IntakeLimits, "limits per request and per rollout")
    add_options(p, config.ConnectionSettings, _CONNECTIONS)
    add_options(p, config.RegistrySettings, "registry")
    state = "state (default: in memory, lost with the process; see docs/state.md)"
    add_options(p, config.StateSettings, state)
    add_options(p, ServeProcess)  # into the sections above: options, access, connections


def serve_config(args: argparse.Namespace) -> GatewayConfig:
    """The :class:`GatewayConfig` of parsed ``serve`` arguments.

    Raises :class:`ServeOptionError` naming the option when the options do not hold
    together (no admin token, open mode on a non-loopback host, unreadable token file,
    an option that needs another one, a rule of the config).
    """
    from rollout_gateway.server import config

    token = _admin_token(args)
    unmet = unmet_requirements(args, [config.StateSettings])
    if unmet is not None:
        raise ServeOptionError(unmet)
    values: dict[str, Any] = {}
    for cls in _settings_classes():
        values.update(values_from(args, cls))
    values.update(
        admin_token=token,
        upstream_api_key=os.environ.get(config.UPSTREAM_API_KEY_ENV) or None,
    )
    for url in values["upstreams"]:
        if _is_own_address(url, args.host, args.port):
            raise ServeOptionError(
                f"--upstream {url}: that is this gateway's own address (--host {args.host} "
                f"--port {args.port}); every turn would call the gateway again"
            )
    if values["upstream_mode"] == "token-in" and values["tokenizer"] is None:
        values["tokenizer"] = served_model_path(values["upstreams"][0])
        if values["tokenizer"] is None:
            raise ServeOptionError(
                "--tokenizer: required with --upstream-mode token-in (the upstream's "
                "/v1/models names no local model directory)"
            )
    try:
        return config.GatewayConfig.from_fields(**values)
    except ConfigError as e:
        raise ServeOptionError(e.command_line) from None


def _settings_classes() -> tuple[type[Any], ...]:
    """Every class whose options ``serve`` has (the gateway's settings)."""
    from rollout_gateway.server import config

    return (
        config.GatewayConfig,
        config.UpstreamSettings,
        config.RolloutLimits,
        config.IntakeLimits,
        config.ConnectionSettings,
        config.RegistrySettings,
        config.StateSettings,
    )


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin token ``serve`` runs with (``None``: open control plane). Each refusal
    names the fix the README uses: ``--create-admin-token``."""
    from rollout_gateway.admin_token import ADMIN_TOKEN_FILE_ENV
    from rollout_gateway.server.http.auth import AdminTokenError, is_loopback_host, load_admin_token

    try:
        token = load_admin_token(args.admin_token_file)
    except AdminTokenError as e:
        path = args.admin_token_file or os.environ.get(ADMIN_TOKEN_FILE_ENV)
        if not path:
            raise ServeOptionError(f"$ROLLOUT_GATEWAY_ADMIN_TOKEN: {e}; {_CREATE}") from None
        source = (
            f"--admin-token-file {path}" if args.admin_token_file else f"${ADMIN_TOKEN_FILE_ENV}"
        )
        if not os.path.exists(os.path.expanduser(path)):
            fix = "add --create-admin-token to write a fresh one there (mode 0600)"
        else:  # --create-admin-token never replaces a file
            fix = "fix or remove it (--create-admin-token writes a fresh one where none exists)"
        raise ServeOptionError(f"{source}: {e}; {fix}") from None
    if args.open_control_plane:
        if token is not None:
            raise ServeOptionError("--open-control-plane: an admin token is configured too")
        if not is_loopback_host(args.host):
            raise ServeOptionError(
                f"--open-control-plane: only on a loopback --host, not {args.host!r}"
            )
    elif token is None:
        raise ServeOptionError(
            f"no admin token: {_CREATE}, or name an existing one with --admin-token-file "
            "PATH or $ROLLOUT_GATEWAY_ADMIN_TOKEN (--open-control-plane runs without one, "
            "on loopback only)"
        )
    return token


_CREATE = (
    "add --admin-token-file PATH --create-admin-token to write a fresh one (mode 0600) and use it"
)


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


__all__ = [
    "LOG_LEVELS",
    "ServeOptionError",
    "ServeProcess",
    "add_serve_arguments",
    "log_level_option",
    "prepare_admin_token_file",
    "served_model_path",
    "serve_config",
    "typed_options",
]
