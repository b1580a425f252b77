"""One server a test or benchmark starts: its own process group, dead with its parent.

:func:`serving` starts a command through :func:`rollout_gateway.child_processes.spawn`
(a process group of its own; the kernel kills it should the test or benchmark die, even
by ``kill -9``), waits until a URL of it answers, and stops its group on the way out.
What ``rollout-gateway serve``, ``scripted-model`` and the benchmarks' own servers are
started with, so that a killed pytest or benchmark leaves nothing serving.

    with serving([sys.executable, "-m", "rollout_gateway.cli", "serve", ...],
                 f"{root}/health") as proc:
        ...
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from rollout_gateway import child_processes

#: How long a server may take to answer before its start fails.
START_TIMEOUT_S = 30.0


def answered(status: int) -> bool:
    """The default readiness: anything but a server error."""
    return status < 500


@contextlib.contextmanager
def serving(
    cmd: Sequence[str],
    ready_url: str,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    headers: dict[str, str] | None = None,
    ready: Callable[[int], bool] = answered,
    preexec: Callable[[], None] | None = None,
    stdout: int | IO[Any] | None = subprocess.DEVNULL,
    stderr: int | IO[Any] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` running (``env`` over this process's), once ``ready_url`` answers a status
    ``ready`` accepts; its process group stopped on the way out (:func:`stop_group`).

    ``preexec`` runs in the child before ``exec`` (resource limits)."""
    proc = child_processes.spawn(
        cmd,
        stdout=stdout,
        stderr=stderr,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        preexec=preexec,
    )
    try:
        wait_ready(proc, ready_url, headers=headers, ready=ready, timeout_s=timeout_s)
        yield proc
    finally:
        stop_group(proc)


def wait_ready(
    proc: subprocess.Popen[Any],
    url: str,
    *,
    headers: dict[str, str] | None = None,
    ready: Callable[[int], bool] = answered,
    timeout_s: float = START_TIMEOUT_S,
) -> None:
    """Wait until ``url`` answers a status ``ready`` accepts; an error naming the command
    if it exits first or does not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{_name(proc)} exited with {proc.returncode} at start")
        with contextlib.suppress(httpx.HTTPError):
            if ready(httpx.get(url, timeout=1, headers=headers).status_code):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_name(proc)} did not answer {url} in {timeout_s:.0f} s")
        time.sleep(0.05)


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM to the process group ``proc`` leads, SIGKILL after ``grace_s``; whatever
    else is left in the group (its children) is killed. Idempotent."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # its own group (spawn's new session), nothing else


def _name(proc: subprocess.Popen[Any]) -> str:
    args = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    words = [str(a) for a in args]
    if "rollout_gateway.cli" in words:
        return " ".join(words[words.index("rollout_gateway.cli") + 1 :][:1]) or "rollout-gateway"
    return Path(words[0]).name if words else "the server"
