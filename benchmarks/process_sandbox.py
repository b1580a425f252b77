"""A benchmark-only sandbox client whose cost to the env does not follow the machine.

``env_instructions.py --sandbox process`` gives it to the classic env through the
mixin's ``sandbox_client`` seam (``fix_bug_env.load_environment(sandbox_client=...)``,
the same keyword in this checkout and in the base ``368ce21``), so that a rollout's
count in the env process is the mixin's and the env's work, not the local sandboxes'.
Their cost follows the machine: a command is waited for by polling (``pidfd_open``,
which would wake the loop at once, is unknown to valgrind 3.19, so a counted env polls
in both checkouts), and deleting a sandbox reads ``/proc`` for every process on the
machine. Here:

* a sandbox is a directory (its working directory and ``HOME``) and the processes
  started in it; no isolation, limits or reaper: only for the benchmark's own agent;
* ``execute_command`` runs ``/bin/sh -c`` in its own session, its output to files, and
  waits by a blocking ``waitpid`` in a thread of its own that wakes the event loop once
  when the command exits (no polling loop, whatever the command's length);
* a background job is started the same way; ``get_background_job`` asks with one
  ``waitpid(WNOHANG)`` (how often is the mixin's choice);
* ``delete`` kills what still runs by process group (the sessions it started) and
  removes the directory: no scan of ``/proc``.

It imports nothing of ``rollout_gateway``: both checkouts run this same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_sandboxes import (
    APIError,
    BackgroundJob,
    BackgroundJobStatus,
    CommandResponse,
    CommandTimeoutError,
    CreateSandboxRequest,
)

#: prime-sandboxes' default for ``execute_command``.
DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class CreatedSandbox:
    """What ``create`` returns: verifiers reads the ``id`` only."""

    id: str
    name: str


@dataclass
class _Sandbox:
    id: str
    directory: Path
    env: dict[str, str]
    jobs: dict[str, tuple[BackgroundJob, subprocess.Popen[bytes]]] = field(default_factory=dict)
    running: set[subprocess.Popen[bytes]] = field(default_factory=set)
    commands: int = 0


class ProcessSandboxClient:
    """prime-sandboxes' async client methods that the classic env calls, on plain
    processes in a directory per sandbox (under ``root``, a temporary directory by
    default, removed by :meth:`teardown`)."""

    def __init__(self, root: Path | None = None) -> None:
        self._owns_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="process-sandbox-")) if root is None else root
        self._sandboxes: dict[str, _Sandbox] = {}
        self._numbers = itertools.count(1)

    async def create(self, request: CreateSandboxRequest) -> CreatedSandbox:
        """A fresh directory with the request's environment (nothing of the host's but
        the interpreter's directory first on ``PATH``)."""
        sandbox_id = f"process-{next(self._numbers):06d}"
        directory = self.root / sandbox_id
        (directory / ".state").mkdir(parents=True)
        path = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
        env = {"PATH": path, "HOME": str(directory), "TMPDIR": str(directory), "LANG": "C.UTF-8"}
        for extra in (request.environment_vars, request.secrets):
            env.update({k: str(v) for k, v in (extra or {}).items()})
        self._sandboxes[sandbox_id] = _Sandbox(sandbox_id, directory, env)
        return CreatedSandbox(sandbox_id, request.name)

    async def wait_for_creation(self, sandbox_id: str, **_: Any) -> None:
        """Ready at creation."""
        self._get(sandbox_id)

    async def execute_command(
        self,
        sandbox_id: str,
        command: str,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
        timeout: int | None = None,
        user: str | None = None,
    ) -> CommandResponse:
        """Run ``command`` and wait for its exit (``CommandTimeoutError`` after
        ``timeout`` seconds, the command's session killed)."""
        sb = self._get(sandbox_id)
        sb.commands += 1
        out, err = (sb.directory / ".state" / f"exec{sb.commands}.{s}" for s in ("out", "err"))
        proc = self._spawn(sb, command, working_dir, env, out, err)
        exited = _exit_future(proc)
        limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
        try:
            rc = await asyncio.wait_for(asyncio.shield(exited), limit)
        except BaseException as e:
            _kill(proc)
            await exited
            sb.running.discard(proc)
            if isinstance(e, TimeoutError):
                raise CommandTimeoutError(sandbox_id, command, limit) from e
            raise
        sb.running.discard(proc)
        return CommandResponse(stdout=_read(out), stderr=_read(err), exit_code=_code(rc))

    async def start_background_job(
        self,
        sandbox_id: str,
        command: str,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
    ) -> BackgroundJob:
        """Start ``command``; ask after it with :meth:`get_background_job`."""
        sb = self._get(sandbox_id)
        job_id = f"job{len(sb.jobs) + 1}"
        state = sb.directory / ".state"
        job = BackgroundJob(
            job_id=job_id,
            sandbox_id=sandbox_id,
            stdout_log_file=str(state / f"{job_id}.stdout"),
            stderr_log_file=str(state / f"{job_id}.stderr"),
            exit_file=str(state / f"{job_id}.exit"),
        )
        out, err = Path(job.stdout_log_file), Path(job.stderr_log_file)
        sb.jobs[job_id] = (job, self._spawn(sb, command, working_dir, env, out, err))
        return job

    async def get_background_job(
        self, sandbox_id: str, job: BackgroundJob, timeout: int | None = None
    ) -> BackgroundJobStatus:
        """The job's status: one ``waitpid(WNOHANG)`` while it runs."""
        sb = self._get(sandbox_id)
        if job.job_id not in sb.jobs:
            raise APIError(f"HTTP 404: background job {job.job_id} not found in {sandbox_id}")
        proc = sb.jobs[job.job_id][1]
        rc = proc.poll()
        if rc is None:
            return BackgroundJobStatus(job_id=job.job_id, completed=False)
        sb.running.discard(proc)
        return BackgroundJobStatus(
            job_id=job.job_id,
            completed=True,
            exit_code=_code(rc),
            stdout=_read(Path(job.stdout_log_file)),
            stderr=_read(Path(job.stderr_log_file)),
        )

    async def delete(self, sandbox_id: str) -> dict[str, Any]:
        """Kill what still runs in the sandbox and remove its directory."""
        self._delete(sandbox_id)
        return {"success": True, "sandbox_id": sandbox_id}

    async def bulk_delete(self, sandbox_ids: list[str] | None = None, **_: Any) -> dict[str, Any]:
        """Delete the given sandboxes."""
        for sandbox_id in sandbox_ids or []:
            self._delete(sandbox_id)
        return {"succeeded": list(sandbox_ids or []), "failed": []}

    def delete_all(self) -> None:
        """Delete every sandbox (the mixin's teardown calls this)."""
        for sandbox_id in list(self._sandboxes):
            self._delete(sandbox_id)

    def teardown(self, wait: bool = True) -> None:
        """Delete every sandbox and, if this client made it, its root."""
        self.delete_all()
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def _get(self, sandbox_id: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise APIError(f"HTTP 404: Sandbox {sandbox_id} not found")
        return sb

    def _delete(self, sandbox_id: str) -> None:
        sb = self._sandboxes.pop(sandbox_id, None)
        if sb is None:
            return
        for proc in sb.running:
            _kill(proc)
            proc.wait()
        shutil.rmtree(sb.directory, ignore_errors=True)

    def _spawn(
        self,
        sb: _Sandbox,
        command: str,
        working_dir: str | None,
        env: dict[str, str] | None,
        stdout: Path,
        stderr: Path,
    ) -> subprocess.Popen[bytes]:
        """``/bin/sh -c command`` in its own session, from the sandbox's directory."""
        cwd = sb.directory / working_dir if working_dir else sb.directory
        with stdout.open("wb") as out, stderr.open("wb") as err:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", command],
                cwd=cwd,
                env={**sb.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        sb.running.add(proc)
        return proc


def _exit_future(proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future of ``proc``'s return code, set once by a thread blocked in ``waitpid``."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()

    def wait() -> None:
        rc = proc.wait()  # no timeout: one blocking waitpid, no polling
        loop.call_soon_threadsafe(exited.set_result, rc)

    threading.Thread(target=wait, name=f"wait-{proc.pid}", daemon=True).start()
    return exited


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s session (its process group), if it still runs."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _code(rc: int) -> int:
    """A shell's exit status for a return code (a signal ``N``: ``128 + N``)."""
    return 128 - rc if rc < 0 else rc


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


__all__ = ["CreatedSandbox", "ProcessSandboxClient"]
