"""The env side's admin token: read once, then out of reach of every process the env starts.

The control-plane token lets its holder read, cancel or drive every rollout on a gateway,
so no agent may ever see it. Where an env reads it (:meth:`GatewaySettings.
resolved_admin_token`, the v1 gateway env when it starts serving), :func:`take_admin_token`

- reads ``$<VAR>_FILE`` (a file holding the token: ``ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE``
  by default; the same variable ``rollout-gateway serve`` reads), else ``$<VAR>``
  (``ROLLOUT_GATEWAY_ADMIN_TOKEN``);
- removes both variables from this process's environment (``os.environ``), so nothing
  started afterwards inherits them: not verifiers v1's ``subprocess`` runtime (which
  passes the env process's environment on, less names containing ``API_KEY``), not tool
  servers, not any helper;
- keeps the token in this process's memory for every later reader.

The local sandboxes never pass the host environment on at all; this closes the runtimes
that do. A token file is the better hand-over: the secret is never in any environment,
only its path is (and that variable is removed too). What an uncontained runtime's agent
could still reach (it runs as the env's user): see ``docs/security.md``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from rollout_gateway.errors import GatewayConfigError

#: Environment variable holding the gateway's control-plane token, by default.
ADMIN_TOKEN_ENV = "ROLLOUT_GATEWAY_ADMIN_TOKEN"
#: Suffix of the variable naming a file that holds it (``ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE``).
FILE_SUFFIX = "_FILE"

_taken: dict[str, str] = {}
_lock = threading.Lock()


def take_admin_token(var: str = ADMIN_TOKEN_ENV) -> str | None:
    """The admin token of ``var`` (see the module docstring); ``None`` when none is set.

    Raises :class:`GatewayConfigError` when ``$<var>_FILE`` names a file that cannot be
    read or is empty.
    """
    if not var:
        return None
    file_var = var + FILE_SUFFIX
    with _lock:
        path = os.environ.pop(file_var, None)
        value = os.environ.pop(var, None)
        if path:
            try:
                token = Path(path).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise GatewayConfigError(
                    f"cannot read the admin token file ${file_var}={path}: {e}"
                ) from None
            if not token:
                raise GatewayConfigError(f"the admin token file ${file_var}={path} is empty")
            _taken[var] = token
        elif value is not None and value.strip():
            _taken[var] = value.strip()
        return _taken.get(var)


def forget_admin_tokens() -> None:
    """Drop the tokens taken so far (tests: each starts from its own environment)."""
    with _lock:
        _taken.clear()


__all__ = ["ADMIN_TOKEN_ENV", "FILE_SUFFIX", "forget_admin_tokens", "take_admin_token"]
