"""Which verifiers stack this environment has, and the error naming the extra to install.

rollout-gateway serves two generations of verifiers, each from its own extra, and the
two extras exclude each other: ``rollout-gateway[classic]`` (verifiers 0.3,
:class:`rollout_gateway.RolloutGatewayMixin`) and ``rollout-gateway[v1]`` (verifiers 0.4,
:mod:`rollout_gateway.v1`). Importing an adapter on the other stack (or without
verifiers) raises :class:`WrongStackError` before any verifiers import can fail with a
message about verifiers' internals. Reads package metadata only: imports nothing.
"""

from __future__ import annotations

from importlib import metadata

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


def wrong_stack_error(stack: str, what: str) -> WrongStackError:
    """The error for ``what`` (an import), which needs ``stack``, in this environment."""
    needs, extra, _ = _STACKS[stack]
    version = verifiers_version()
    has = f"verifiers {version}" if version else "no verifiers"
    message = (
        f"{what} needs the {stack} stack ({needs}); this environment has {has}. "
        f"Install it with: pip install '{extra}'"
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
    "installed_stack",
    "require_stack",
    "verifiers_version",
    "wrong_stack_error",
]
