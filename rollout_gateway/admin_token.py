"""The control-plane admin token that the gateway and the env share, kept in a file.

The gateway (``rollout-gateway serve``) and the env must hold the same token. The way
that keeps it out of every agent's reach is a file readable by its owner only: ``serve
--admin-token-file PATH --create-admin-token`` writes a fresh token there (mode 0600)
when the file does not exist, and the env reads it through
``ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE=PATH`` (a path, not the secret, is what sits in the
env's environment; a contained sandbox sees neither the variable nor the file).

The env side reads it once, with :func:`take_admin_token` (:meth:`GatewaySettings.
resolved_admin_token`, the v1 gateway env when it starts serving, the v1 interception):

- it reads the file ``$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE`` names, else the variable
  (``$ROLLOUT_GATEWAY_ADMIN_TOKEN``, or the one the settings name);
- it removes those variables from this process's environment (``os.environ``), so
  nothing started afterwards inherits them: not verifiers v1's ``subprocess`` runtime
  (which passes the env process's environment on, less names containing ``API_KEY``),
  not tool servers, not any helper;
- it keeps the token in this process's memory for every later reader.

The local sandboxes never pass the host environment on at all; this closes the runtimes
that do. What an agent of an uncontained runtime can still reach (it runs as the env's
user: the token file itself, ``/proc/<env pid>/environ`` as it was at exec): see the docs'
security page.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from rollout_gateway.errors import GatewayConfigError

#: Environment variable holding the admin token itself.
ADMIN_TOKEN_ENV = "ROLLOUT_GATEWAY_ADMIN_TOKEN"
#: Environment variable naming a file that holds the admin token (read first).
ADMIN_TOKEN_FILE_ENV = "ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE"


class AdminTokenFileError(GatewayConfigError):
    """The admin token file cannot be created or read (the message names the file)."""


def new_admin_token() -> str:
    """A fresh admin token: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def create_admin_token_file(path: str | os.PathLike[str]) -> bool:
    """Write a fresh token to ``path`` (mode 0600) unless the file exists.

    Returns whether it created the file. Missing parent directories are created with
    mode 0700. The file is created exclusively, so two processes racing to create it
    agree on one token.
    """
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError as e:
        raise AdminTokenFileError(f"cannot create the admin token file {target}: {e}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(new_admin_token() + "\n")
    return True


def read_admin_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (surrounding whitespace removed); refuses an empty file."""
    target = Path(path).expanduser()
    try:
        token = target.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise AdminTokenFileError(f"cannot read the admin token file {target}: {e}") from None
    if not token:
        raise AdminTokenFileError(f"the admin token file {target} is empty")
    return token


@dataclass(frozen=True)
class _Taken:
    token: str | None  # None: the file could not be read (``error`` says why)
    source: str  # where it came from, for messages: never the token itself
    error: str | None = None


_taken: dict[str, _Taken] = {}
_lock = threading.Lock()


def take_admin_token(var: str = ADMIN_TOKEN_ENV) -> str | None:
    """The env side's admin token, read once (see the module docstring).

    Reads the file named by ``$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE``, else ``$<var>``; then
    removes both (and ``$ROLLOUT_GATEWAY_ADMIN_TOKEN``) from ``os.environ`` and keeps the
    token in memory, so later calls return it with the variables gone. A variable set
    again later is read again (and removed again). ``None`` when no token was ever given.

    Raises :class:`AdminTokenFileError` naming the variable when the file cannot be read
    or is empty (and again on every later call, until a variable is set again).
    """
    with _lock:
        path, value = _pop_admin_token_variables(var)
        if path:
            source = f"the admin token in {path} (the file ${ADMIN_TOKEN_FILE_ENV} named)"
            try:
                _taken[var] = _Taken(read_admin_token_file(path), source)
            except AdminTokenFileError as e:
                _taken[var] = _Taken(None, source, f"${ADMIN_TOKEN_FILE_ENV}: {e}")
        elif value is not None and value.strip():
            _taken[var] = _Taken(value.strip(), f"the admin token in ${var}")
        taken = _taken.get(var)
    if taken is None:
        return None
    if taken.error is not None:
        raise AdminTokenFileError(taken.error)
    return taken.token


def discard_admin_token_variables(var: str = ADMIN_TOKEN_ENV) -> None:
    """Remove the admin token's variables from ``os.environ`` without reading them (an
    env given its token explicitly: nothing it starts inherits them either)."""
    with _lock:
        _pop_admin_token_variables(var)


def admin_token_source(var: str = ADMIN_TOKEN_ENV) -> str | None:
    """Where :func:`take_admin_token` found the token of ``var`` (for messages), or ``None``."""
    with _lock:
        taken = _taken.get(var)
    return taken.source if taken else None


def forget_admin_tokens() -> None:
    """Drop the tokens taken so far (tests: each starts from its own environment)."""
    with _lock:
        _taken.clear()


def _pop_admin_token_variables(var: str) -> tuple[str | None, str | None]:
    """Pop the file variable, ``$<var>`` and ``$ROLLOUT_GATEWAY_ADMIN_TOKEN`` (by its name
    it holds this token, whatever ``var`` says; kept in memory under its own name)."""
    path = os.environ.pop(ADMIN_TOKEN_FILE_ENV, None)
    value = os.environ.pop(var, None) if var else None
    default = os.environ.pop(ADMIN_TOKEN_ENV, None)
    if default is not None and default.strip() and var != ADMIN_TOKEN_ENV:
        _taken[ADMIN_TOKEN_ENV] = _Taken(default.strip(), f"the admin token in ${ADMIN_TOKEN_ENV}")
    return path, value


def readable_by_others(path: str | os.PathLike[str]) -> bool:
    """Whether users other than the file's owner may read it (group or other bits)."""
    try:
        mode = Path(path).expanduser().stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IRGRP | stat.S_IROTH))


__all__ = [
    "ADMIN_TOKEN_ENV",
    "ADMIN_TOKEN_FILE_ENV",
    "AdminTokenFileError",
    "admin_token_source",
    "create_admin_token_file",
    "discard_admin_token_variables",
    "forget_admin_tokens",
    "new_admin_token",
    "read_admin_token_file",
    "readable_by_others",
    "take_admin_token",
]
