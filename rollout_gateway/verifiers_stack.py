"""Which verifiers stack this environment has, and the error naming the extra to install.

rollout-gateway serves two generations of verifiers, each from its own extra, and the
two extras exclude each other: ``rollout-gateway[classic]`` (verifiers 0.3,
:class:`rollout_gateway.RolloutGatewayMixin`) and ``rollout-gateway[v1]`` (verifiers 0.4,
:mod:`rollout_gateway.v1`). Importing an adapter on the other stack (or without
verifiers) raises :class:`WrongStackError` before any verifiers import can fail with a
message about verifiers' internals. Reads package metadata only: imports nothing.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

CLASSIC = "classic"
V1 = "v1"

#: What each stack is, for messages.
_STACKS = {
    CLASSIC: ("verifiers 0.3", "rollout-gateway[classic]", "rollout_gateway.RolloutGatewayMixin"),
    V1: ("verifiers 0.4", "rollout-gateway[v1]", "rollout_gateway.v1"),
}


class WrongStackError(ImportError):
    """An adapter was imported where its verifiers stack is not installed."""


def verifiers_version() -> str | None:
    """The installed verifiers version, or None."""
    try:
        return metadata.version("verifiers")
    except metadata.PackageNotFoundError:
        return None


def installed_stack() -> str | None:
    """``"v1"`` with verifiers 0.4 or later, ``"classic"`` with 0.3, None without verifiers."""
    version = verifiers_version()
    if version is None:
        return None
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    return V1 if (major, minor) >= (0, 4) else CLASSIC


def install_command(extra: str) -> str:
    """A ``pip install`` command that installs rollout-gateway with ``extra`` from where
    this one came from: its checkout (``-e``, as the README's commands do), the wheel file
    it was installed from, or a package index. (rollout-gateway is not on a public index:
    ``pip install 'rollout-gateway[v1]'`` only works where an index serves it.)"""
    source = _installed_from()
    if source is None:
        return f"pip install 'rollout-gateway[{extra}]'"
    path, editable = source
    return f"pip install {'-e ' if editable else ''}'{path}[{extra}]'"


def _installed_from() -> tuple[str, bool] | None:
    """(the checkout or wheel file, installed editable) of this rollout-gateway, or None
    when it came from an index. A package that lives in a checkout is that checkout's."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return str(checkout), True
    try:
        info = json.loads(
            metadata.distribution("rollout-gateway").read_text("direct_url.json") or ""
        )
    except (metadata.PackageNotFoundError, ValueError):
        return None
    url = urlsplit(str(info.get("url") or ""))
    if url.scheme != "file":
        return None
    return unquote(url.path), bool((info.get("dir_info") or {}).get("editable"))


def wrong_stack_error(stack: str, what: str) -> WrongStackError:
    """The error for ``what`` (an import), which needs ``stack``, in this environment."""
    needs, _, _ = _STACKS[stack]
    version = verifiers_version()
    has = f"verifiers {version}" if version else "no verifiers"
    message = (
        f"{what} needs the {stack} stack ({needs}); this environment has {has}. "
        f"Install it with: {install_command(stack)}"
    )
    other = installed_stack()
    if other is not None and other != stack:
        other_needs, _, other_api = _STACKS[other]
        message += (
            f" in a virtualenv of its own (the [{stack}] and [{other}] extras exclude each "
            f"other); on {other_needs} use {other_api}"
        )
    return WrongStackError(message)


def require_stack(stack: str, what: str) -> None:
    """Raise :class:`WrongStackError` unless this environment has ``stack``."""
    if installed_stack() != stack:
        raise wrong_stack_error(stack, what)


__all__ = [
    "CLASSIC",
    "V1",
    "WrongStackError",
    "install_command",
    "installed_stack",
    "require_stack",
    "verifiers_version",
    "wrong_stack_error",
]
