"""prime-sandboxes' command methods (execute, background jobs) for local sandboxes.

Every command runs with ``/bin/sh -c`` inside the sandbox's confinement (its isolation
mode's command line), with the sandbox's environment and rlimits, and is killed with its
process group when cancelled, timed out, or when the sandbox is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
import uuid
from pathlib import Path
from typing import Any

from prime_sandboxes import (
    APIError,
    BackgroundJob,
    BackgroundJobStatus,
    CommandResponse,
    CommandTimeoutError,
    StartCommand,
)

from rollout_gateway.local_sandbox import processes
from rollout_gateway.local_sandbox.registry import SandboxRegistry
from rollout_gateway.local_sandbox.sandbox import Job, LocalSandbox, shell_script

# Start commands that only keep a container alive; a local sandbox needs no such process.
_KEEPALIVE_COMMANDS = {"tail -f /dev/null", "sleep infinity", ""}
_DEFAULT_EXEC_TIMEOUT = 300  # prime-sandboxes' default for execute_command


class SandboxCommandAPI:
    """The command half of :class:`~rollout_gateway.local_sandbox.LocalSandboxClient`."""

    _registry: SandboxRegistry
    _apply_rlimits: bool
    _max_output_bytes: int
    _read_only: Any
    _read_only_at: Any

    async def _running(self, sandbox_id: str, command: str | None = None) -> LocalSandbox:
        raise NotImplementedError

    async def execute_command(
        self,
        sandbox_id: str,
        command: str,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
        timeout: int | None = None,
        user: str | None = None,
    ) -> CommandResponse:
        """Run ``command`` with ``/bin/sh -c`` and wait for it.

        Raises ``CommandTimeoutError`` after ``timeout`` seconds (default 300; the
        command is killed), ``SandboxNotRunningError`` / ``SandboxTimeoutError`` when the
        sandbox is gone.
        """
        sb = await self._running(sandbox_id, command)
        effective_timeout = timeout if timeout is not None else _DEFAULT_EXEC_TIMEOUT
        n = sb.next_number()
        out_path = sb.dirs.state / f"exec_{n}.stdout"
        err_path = sb.dirs.state / f"exec_{n}.stderr"
        spawning = asyncio.ensure_future(
            self._spawn(sb, command, working_dir, env, user, out_path, err_path)
        )
        try:
            proc = await asyncio.shield(spawning)
        except asyncio.CancelledError:
            # Cancelled while the process was being started: it still starts; end it.
            with contextlib.suppress(Exception):
                started = await spawning
                await asyncio.to_thread(processes.kill_group, started)
            raise
        try:
            rc = await processes.wait_proc(proc, effective_timeout)
            if rc is None:
                raise CommandTimeoutError(sandbox_id, command, effective_timeout)
        except BaseException:
            # Cancelled or timed out: leave no runaway behind (shielded from the cancel).
            await asyncio.shield(asyncio.to_thread(processes.kill_group, proc))
            raise
        finally:
            with sb.lock:
                sb.procs.discard(proc)
        if sb.dead:
            self._registry.raise_missing(sb.id, command)

        def collect() -> tuple[str, str]:
            try:
                return _read_tail(out_path, None)[0], _read_tail(err_path, None)[0]
            finally:
                out_path.unlink(missing_ok=True)
                err_path.unlink(missing_ok=True)

        await asyncio.to_thread(self._registry.enforce_sandbox, sb, proc)
        stdout, stderr = await asyncio.to_thread(collect)
        return CommandResponse(
            stdout=stdout,
            stderr=_with_breach(sb, proc, stderr),
            exit_code=processes.exit_code(rc),
        )

    async def start_background_job(
        self,
        sandbox_id: str,
        command: str,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
    ) -> BackgroundJob:
        """Start ``command`` in the background; poll it with :meth:`get_background_job`.

        The handle's log/exit file paths are host paths in the sandbox's host-owned state
        directory (readable with :meth:`read_file`, not writable by the sandbox).
        """
        sb = await self._running(sandbox_id, command)
        job_id = uuid.uuid4().hex[:8]
        state = sb.dirs.state
        job = BackgroundJob(
            job_id=job_id,
            sandbox_id=sandbox_id,
            stdout_log_file=str(state / f"job_{job_id}.stdout.log"),
            stderr_log_file=str(state / f"job_{job_id}.stderr.log"),
            exit_file=str(state / f"job_{job_id}.exit"),
        )
        out, err = Path(job.stdout_log_file), Path(job.stderr_log_file)
        proc = await self._spawn(sb, command, working_dir, env, user, out, err)
        with sb.lock:
            sb.jobs[job_id] = Job(job=job, proc=proc)
        return job

    async def get_background_job(
        self,
        sandbox_id: str,
        job: BackgroundJob,
        timeout: int | None = None,
    ) -> BackgroundJobStatus:
        """Return the job's status; cheap (one ``waitpid``) while it is still running."""
        sb = await self._running(sandbox_id)
        with sb.lock:
            entry = sb.jobs.get(job.job_id)
        if entry is None:
            raise APIError(f"HTTP 404: background job {job.job_id} not found in {sandbox_id}")
        if entry.status is not None:
            return entry.status
        rc = entry.proc.poll()  # type: ignore[attr-defined]
        if rc is None:
            return BackgroundJobStatus(job_id=job.job_id, completed=False)
        with sb.lock:
            sb.procs.discard(entry.proc)
        code = processes.exit_code(rc)
        limit = self._max_output_bytes

        def collect() -> BackgroundJobStatus:
            with contextlib.suppress(OSError):
                Path(job.exit_file).write_text(f"{code}\n")
            stdout, out_trunc = _read_tail(Path(job.stdout_log_file), limit)
            stderr, err_trunc = _read_tail(Path(job.stderr_log_file), limit)
            return BackgroundJobStatus(
                job_id=job.job_id,
                completed=True,
                exit_code=code,
                stdout=stdout,
                stderr=_with_breach(sb, entry.proc, stderr),
                stdout_truncated=out_trunc,
                stderr_truncated=err_trunc,
            )

        await asyncio.to_thread(self._registry.enforce_sandbox, sb, entry.proc)
        entry.status = await asyncio.to_thread(collect)
        return entry.status

    async def run_background_job(
        self,
        sandbox_id: str,
        command: str,
        timeout: int = 900,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
        poll_interval: int = 3,
    ) -> BackgroundJobStatus:
        """Start a background job and wait for it; ``CommandTimeoutError`` after
        ``timeout`` seconds (the job keeps running until the sandbox is deleted, as
        with prime-sandboxes)."""
        job = await self.start_background_job(sandbox_id, command, working_dir=working_dir, env=env)
        deadline = time.monotonic() + timeout
        delay = min(0.01, float(poll_interval))  # local polls are cheap: start fast
        while True:
            status = await self.get_background_job(sandbox_id, job)
            if status.completed:
                return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommandTimeoutError(sandbox_id, command, timeout)
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, max(float(poll_interval), 0.01))

    async def open_process(
        self,
        sandbox_id: str,
        command: str,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Any:
        """Start ``command`` with pipes for stdin, stdout and stderr; returns the
        ``subprocess.Popen``. A local extension of the API (for live processes, e.g.
        verifiers v1's ``open_process``); the process is the sandbox's, killed with it."""
        sb = await self._running(sandbox_id, command)
        return await self._spawn(sb, command, working_dir, env, None, None, None)

    async def _start_main_command(self, sb: LocalSandbox) -> None:
        """Run a non-trivial ``start_command`` as the sandbox's long-lived process."""
        start = sb.request.start_command
        if isinstance(start, StartCommand):
            command = shlex.join([start.executable, *start.args])
        else:
            command = (start or "").strip()
        if command in _KEEPALIVE_COMMANDS:
            return
        log = sb.dirs.state / "main.log"
        await self._spawn(sb, command, None, None, None, log, log)

    async def _spawn(
        self,
        sb: LocalSandbox,
        command: str,
        working_dir: str | None,
        env: dict[str, str] | None,
        user: str | None,
        stdout_path: Path | None,
        stderr_path: Path | None,
    ) -> Any:
        """Start a command in ``sb``; its output goes to the two files, or to pipes when
        both are ``None``."""
        if user is not None:
            raise ValueError("The 'user' parameter is not supported by the local sandbox backend.")
        proc_env = sb.environment(env)
        req = sb.request
        limits = (
            processes.rlimit_args(
                timeout_minutes=req.timeout_minutes,
                cpu_cores=req.cpu_cores,
                # Address space only where no memory cgroup bounds the whole sandbox (it
                # breaks programs that reserve much more than they use).
                memory_gb=req.memory_gb if sb.cgroup is None else None,
                disk_size_gb=req.disk_size_gb,
                # The uid's process count where no pids cgroup counts the sandbox's (the
                # cgroup's refusals are what the watchdog sees).
                nproc=sb.limits.pids if sb.mode.uses_sandbox_uid and sb.cgroup is None else None,
            )
            if self._apply_rlimits
            else []
        )
        confinement = sb.confinement(self._read_only, self._read_only_at)
        prefix = sb.cgroup.enter_argv() if sb.cgroup is not None else None
        script = shell_script(command, working_dir)

        def start() -> Any:
            with sb.lock:  # no process starts once the sandbox is being destroyed
                if sb.dead:
                    self._registry.raise_missing(sb.id, command)
                if stdout_path is None or stderr_path is None:
                    proc = processes.spawn_piped(confinement, script, proc_env, limits, prefix)
                else:
                    proc = processes.spawn(
                        confinement, script, proc_env, stdout_path, stderr_path, limits, prefix
                    )
                sb.procs.add(proc)
                sb.leaders.add(proc.pid)
            return proc

        return await asyncio.to_thread(start)


def _with_breach(sb: LocalSandbox, proc: Any, stderr: str) -> str:
    """A command's stderr, plus why the sandbox was stopped if that ended the command."""
    if sb.breach is None or proc.pid not in sb.stopped_leaders:
        return stderr
    return f"{stderr}{'' if not stderr or stderr.endswith(chr(10)) else chr(10)}" + (
        f"[local sandbox {sb.id} stopped: {sb.breach}]\n"
    )


def _read_tail(path: Path, limit: int | None) -> tuple[str, bool]:
    """Read a file (its last ``limit`` bytes if given); missing reads as empty."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - limit) if limit is not None else 0
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return "", False
    return data.decode("utf-8", errors="replace"), start > 0


__all__ = ["SandboxCommandAPI"]
