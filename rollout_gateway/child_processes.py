"""Child servers that end when the process that started them dies, even by ``kill -9``.

What the test bed, the benchmarks and the soak start (``redis-server``, HAProxy, gateways,
the scripted model, env processes) each run in a process group of their own, stopped by
that group on the way out. A parent killed with ``SIGKILL`` runs no ``finally``: without
more, its children would serve on for hours. :func:`spawn` starts a child with Linux's
parent-death signal (``PR_SET_PDEATHSIG``) set between ``fork`` and ``exec``, so the
kernel kills it when its parent goes, however it goes.

The kernel sends that signal when the *thread* that forked the child exits, not the
process. A server restarted from a short-lived thread (a chaos schedule's, a test's
helper) would be killed when that thread ends, so every child is forked by one daemon
thread of this module that lives as long as the process.

Elsewhere than Linux (no ``prctl``) children start without it (:func:`available` says
so), and the callers' own stop on the way out is all there is.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl


#: Resolved once, in the parent: the child between fork and exec only calls it.
_PRCTL = _load_prctl()

_spawner: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()


def available() -> bool:
    """Whether children get the parent-death signal here (Linux)."""
    return _PRCTL is not None


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies.

    The parent's pid is taken now, before the fork: a parent that died between the fork
    and the ``prctl`` (the signal would never come) is caught by comparing it with
    ``getppid()`` afterwards, and the child signals itself.
    """
    parent = os.getpid()
    prctl = _PRCTL

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)

    return preexec


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _spawner
    with _spawner_lock:
        # A forked copy of this process has the executor but not its thread: a new one.
        if _spawner is None or _spawner[0] != os.getpid():
            # One worker, never shut down: the thread every child is forked from lives as
            # long as the process (the parent-death signal follows the forking thread).
            pool = concurrent.futures.ThreadPoolExecutor(1, "child-spawner")
            _spawner = (os.getpid(), pool)
        return _spawner[1]


def spawn(
    cmd: Sequence[str],
    *,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    new_session: bool = True,
    death_signal: int = signal.SIGKILL,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as a child that gets ``death_signal`` when this process dies.

    ``new_session``: the child leads a session and process group of its own (stopped by
    that group: nothing else is signalled). Forked from this module's long-lived thread.
    """

    def start() -> subprocess.Popen[bytes]:
        preexec = die_with_parent(death_signal)
        return subprocess.Popen(
            list(cmd),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=cwd,
            start_new_session=new_session,
            preexec_fn=preexec if _PRCTL is not None else None,
        )

    return _executor().submit(start).result()


__all__ = ["available", "die_with_parent", "spawn"]
