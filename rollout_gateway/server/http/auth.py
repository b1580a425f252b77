"""Credentials of the gateway: the control-plane admin token and per-rollout keys.

Security model (also in the docs' security page and ``serve --help``):

* the control plane (register, trajectory, cancel, unregister, detailed ``/health``,
  ``/metrics``) needs ``Authorization: Bearer <admin token>``. The token comes from the
  environment variable :data:`ADMIN_TOKEN_ENV` or a file (:data:`ADMIN_TOKEN_FILE_ENV` /
  ``--admin-token-file``; :mod:`rollout_gateway.admin_token` creates and reads it, the env
  side reads the same file), never from a command-line argument (visible in ``ps``);
* without a token the gateway refuses to start unless an open control plane is asked
  for explicitly, and an open gateway only binds to a loopback address;
* the data plane: register hands out a per-rollout key (on by default); chat requests
  present it as a bearer token. A key opens exactly one rollout.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping

from starlette.requests import Request

from rollout_gateway.admin_token import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_FILE_ENV,
    AdminTokenFileError,
    read_admin_token_file,
)

#: Shortest admin token accepted (a guessable token is no protection).
MIN_ADMIN_TOKEN_CHARS = 16


class AdminTokenError(ValueError):
    """The admin token could not be read or is unusable."""


def bearer_token(request: Request) -> str | None:
    """The token of a request's ``Authorization: Bearer <token>`` header, if any."""
    return parse_bearer(request.headers.get("authorization"))


def parse_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization`` header's value ``Bearer <token>``, if it is one."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison (no timing oracle on the secret's prefix)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def load_admin_token(
    token_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The admin token: from ``token_file``, else ``$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE``,
    else ``$ROLLOUT_GATEWAY_ADMIN_TOKEN``; ``None`` when none is configured.

    Raises :class:`AdminTokenError` when the file cannot be read or the token is shorter
    than :data:`MIN_ADMIN_TOKEN_CHARS`.
    """
    env = os.environ if environ is None else environ
    path = token_file or env.get(ADMIN_TOKEN_FILE_ENV) or None
    if path:
        try:
            token = read_admin_token_file(path)
        except AdminTokenFileError as exc:
            raise AdminTokenError(str(exc)) from None
    else:
        token = (env.get(ADMIN_TOKEN_ENV) or "").strip()
        if not token:
            return None
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise AdminTokenError(f"the admin token must have at least {MIN_ADMIN_TOKEN_CHARS} chars")
    return token


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a bind address) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = [
    "ADMIN_TOKEN_ENV",
    "ADMIN_TOKEN_FILE_ENV",
    "MIN_ADMIN_TOKEN_CHARS",
    "AdminTokenError",
    "bearer_token",
    "is_loopback_host",
    "load_admin_token",
    "parse_bearer",
    "token_matches",
]
