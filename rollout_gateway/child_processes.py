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

A caller that needs asyncio's pipes starts its child with :func:`spawn_async` instead:
asyncio forks from the thread that runs the event loop, so that child gets the signal when
the loop's thread ends (the main thread for ``asyncio.run`` and pytest-asyncio).

Elsewhere than Linux (no ``prctl``) children start without it (:func:`available` says
so), and the callers' own stop on the way out is all there is.
"""

from __future__ import annotations

import asyncio
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
from typing import IO, Any, Literal, overload

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

#: What ``spawn(..., whole_group=True)`` runs first: it starts the command as its child, in
#: its group; on its own parent-death signal (SIGHUP) it kills the whole group (a
#: shell's background servers, which no parent-death signal reaches: a fork clears it).
#: Other signals are passed on to the command; it ends as the command ended.
_GROUP_KEEPER = """
import os, signal, subprocess, sys
signal.signal(signal.SIGHUP, lambda *_: os.killpg(0, signal.SIGKILL))
child = subprocess.Popen(sys.argv[1:])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda signum, _: child.send_signal(signum))
code = child.wait()
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

_spawner: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()


def available() -> bool:
    """Whether children get the parent-death signal here (Linux)."""
    return _PRCTL is not None


def die_with_parent(
    sig: int = signal.SIGKILL, then: Callable[[], None] | None = None
) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies.

    The parent's pid is taken now, before the fork: a parent that died between the fork
    and the ``prctl`` (the signal would never come) is caught by comparing it with
    ``getppid()`` afterwards, and the child signals itself. ``then`` (the caller's own
    ``preexec_fn``: resource limits, a signal disposition) runs afterwards.
    """
    parent = os.getpid()
    prctl = _PRCTL

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
        if then is not None:
            then()

    return preexec


def _child_setup(sig: int, then: Callable[[], None] | None) -> Callable[[], None] | None:
    """The ``preexec_fn`` a spawned child gets: the parent-death signal where the
    platform has one, then ``then``; ``None`` when there is nothing to run (without a
    ``preexec_fn``, ``subprocess`` may start the child without a fork)."""
    return die_with_parent(sig, then) if _PRCTL is not None else then


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


_Stream = int | IO[Any] | None


def _kept(
    cmd: Sequence[str], whole_group: bool, new_session: bool, death_signal: int
) -> tuple[list[str], int]:
    """The argv and parent-death signal to start: ``cmd`` under the group keeper when
    ``whole_group``."""
    if not whole_group:
        return list(cmd), death_signal
    if not new_session:
        raise ValueError("whole_group needs new_session: the group is the child's own")
    return [sys.executable, "-I", "-c", _GROUP_KEEPER, *cmd], signal.SIGHUP


@overload
def spawn(
    cmd: Sequence[str],
    *,
    stdout: _Stream = None,
    stderr: _Stream = None,
    stdin: _Stream = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    new_session: bool = True,
    death_signal: int = signal.SIGKILL,
    preexec: Callable[[], None] | None = None,
    text: Literal[False] = False,
    whole_group: bool = False,
) -> subprocess.Popen[bytes]: ...


@overload
def spawn(
    cmd: Sequence[str],
    *,
    stdout: _Stream = None,
    stderr: _Stream = None,
    stdin: _Stream = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    new_session: bool = True,
    death_signal: int = signal.SIGKILL,
    preexec: Callable[[], None] | None = None,
    text: Literal[True],
    whole_group: bool = False,
) -> subprocess.Popen[str]: ...


def spawn(
    cmd: Sequence[str],
    *,
    stdout: _Stream = None,
    stderr: _Stream = None,
    stdin: _Stream = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    new_session: bool = True,
    death_signal: int = signal.SIGKILL,
    preexec: Callable[[], None] | None = None,
    text: bool = False,
    whole_group: bool = False,
) -> subprocess.Popen[Any]:
    """Start ``cmd`` as a child that gets ``death_signal`` when this process dies.

    ``new_session``: the child leads a session and process group of its own (stopped by
    that group: nothing else is signalled). Forked from this module's long-lived thread.
    ``preexec`` runs in the child after the parent-death signal is set; ``text``: its
    pipes are text, as :class:`subprocess.Popen`'s. ``whole_group`` (with
    ``new_session``): everything in the child's process group dies with this process,
    not only the child: for a shell that starts servers in the background (a small
    Python keeper leads the group, runs ``cmd`` and ends as it ends).
    """
    argv, death_signal = _kept(cmd, whole_group, new_session, death_signal)

    def start() -> subprocess.Popen[Any]:
        return subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=cwd,
            start_new_session=new_session,
            preexec_fn=_child_setup(death_signal, preexec),
            text=text,
        )

    return _executor().submit(start).result()


async def spawn_async(
    *cmd: str,
    stdin: _Stream = subprocess.DEVNULL,
    stdout: _Stream = None,
    stderr: _Stream = None,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    new_session: bool = True,
    death_signal: int = signal.SIGKILL,
    limit: int = 2**16,
    whole_group: bool = False,
) -> asyncio.subprocess.Process:
    """:func:`spawn` for a caller that needs asyncio's pipes to the child.

    Forked by asyncio from the thread running the event loop: the child gets
    ``death_signal`` when this process dies or that thread ends (a loop's thread lives
    as long as the loop, and the pipes are the loop's). ``limit``: the stream buffer;
    ``whole_group``: as :func:`spawn`'s.
    """
    argv, death_signal = _kept(cmd, whole_group, new_session, death_signal)
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env=env,
        cwd=cwd,
        start_new_session=new_session,
        preexec_fn=_child_setup(death_signal, None),
        limit=limit,
    )


__all__ = ["available", "die_with_parent", "spawn", "spawn_async"]
