"""The control-plane admin token that the gateway and the env share, kept in a file.

The gateway (``rollout-gateway serve``) and the env must hold the same token. The way
that keeps it out of every agent's reach is a file readable by its owner only: ``serve
--admin-token-file PATH --create-admin-token`` writes a fresh token there (mode 0600)
when the file does not exist, and the env reads it through
``ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE=PATH`` (a path, not the secret, is what sits in the
env's environment; a contained sandbox sees neither the variable nor the file).
"""

from __future__ import annotations

import os
import secrets
import stat
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
    "create_admin_token_file",
    "new_admin_token",
    "read_admin_token_file",
    "readable_by_others",
]
