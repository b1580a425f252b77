"""A local, process-level sandbox backend with prime-sandboxes' client interface.

:class:`LocalSandboxClient` is an async drop-in for the ``sandbox_client`` that
``vf.CliAgentEnv`` / ``SandboxMixin`` use (normally a ``ThreadedAsyncSandboxClient`` in
front of prime-sandboxes' ``AsyncSandboxClient``): same method names, signatures, return
models and exception types, so verifiers' own error handling treats it the same.

**This is development/CI isolation, not a security boundary.** A "sandbox" is a private
temporary directory plus a set of process groups running as the current user:

- Each sandbox gets ``<root>/<sandbox_id>/work`` (the working directory, ``HOME`` and
  ``SANDBOX_ROOT`` of every command), ``<root>/<sandbox_id>/tmp`` (``TMPDIR``) and a state
  directory ``<root>/<sandbox_id>/.state`` (job logs) outside the working directory.
  ``root`` comes from the constructor, else ``$ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT``, else
  ``<system temp dir>/rollout-gateway-sandboxes``.
- Relative paths resolve inside the working directory. Absolute paths in *commands* are
  NOT remapped (there is no container or chroot): ``cat /etc/passwd`` reads the host's.
  The file API (upload/read/download) refuses absolute paths outside the sandbox's own
  directory, so an env written for a container fails loudly instead of writing to the host.
- ``docker_image`` seeds the working directory when it names local content:
  ``local:<path>`` / ``dir:<path>`` / an absolute path, pointing at a directory (copied)
  or a ``.tar`` / ``.tar.gz`` / ``.tgz`` archive (extracted). Any other value (a real
  image name such as ``python:3.11-slim``) means an empty directory; the host's tools
  are used instead (``python``/``python3`` resolve to the current interpreter first).
- Every command runs as ``/bin/sh -c`` in its own session (``start_new_session``), with
  an environment holding only ``PATH``, ``HOME``, ``LANG``, ``TMPDIR``, ``SANDBOX_ROOT``,
  the request's ``environment_vars``/``secrets`` and the call's ``env``: never the host's
  environment. Best-effort rlimits apply: CPU time, address space (``memory_gb``) and
  largest file size (``disk_size_gb``, per file, not a disk quota). No network, PID or
  GPU isolation; ``RLIMIT_NPROC`` is not used because it counts all of the user's
  processes on the host.
- ``timeout_minutes`` is enforced: a sandbox past its lifetime is killed and removed,
  and later calls raise ``SandboxTimeoutError`` as prime-sandboxes does.
- ``delete``/``teardown``/``delete_all`` kill every process of the sandbox (its process
  groups, plus on Linux any process carrying the sandbox's marker environment variable,
  which catches ``setsid`` escapes), SIGTERM then SIGKILL, and remove its directory.

prime-sandboxes remains the backend for real training.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import math
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prime_sandboxes import (
    APIError,
    BackgroundJob,
    BackgroundJobStatus,
    BulkDeleteSandboxResponse,
    CommandResponse,
    CommandTimeoutError,
    CreateSandboxRequest,
    FileUploadResponse,
    ReadFileResponse,
    Sandbox,
    SandboxFileNotFoundError,
    SandboxFileTooLargeError,
    SandboxImagePullError,
    SandboxNotRunningError,
    SandboxTimeoutError,
    StartCommand,
)

__all__ = ["LocalSandboxClient", "ROOT_ENV_VAR", "MARKER_ENV_VAR", "default_root"]

logger = logging.getLogger(__name__)

ROOT_ENV_VAR = "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT"
"""Environment variable naming the directory under which sandboxes are created."""

MARKER_ENV_VAR = "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ID"
"""Set in every sandboxed process so stragglers can be found and killed by sandbox."""

_GiB = 1024**3
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Start commands that only keep a container alive; a local sandbox needs no such process.
_KEEPALIVE_COMMANDS = {"tail -f /dev/null", "sleep infinity", ""}
_DEFAULT_EXEC_TIMEOUT = 300  # prime-sandboxes' default for execute_command
_MAX_TOMBSTONES = 100_000


def default_root() -> Path:
    """The sandbox root used when none is passed: ``$ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT``
    or ``<system temp dir>/rollout-gateway-sandboxes``."""
    env_root = os.environ.get(ROOT_ENV_VAR)
    if env_root:
        return Path(env_root)
    return Path(tempfile.gettempdir()) / "rollout-gateway-sandboxes"


@dataclass
class _Job:
    job: BackgroundJob
    proc: subprocess.Popen[bytes]
    status: BackgroundJobStatus | None = None  # cached once completed


@dataclass
class _LocalSandbox:
    id: str
    request: CreateSandboxRequest
    base: Path
    created_at: datetime
    deadline: float
    status: str = "RUNNING"
    error_type: str | None = None
    error_message: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False
    procs: set[subprocess.Popen[bytes]] = field(default_factory=set)
    jobs: dict[str, _Job] = field(default_factory=dict)
    leaders: set[int] = field(default_factory=set)  # pid (= session id) of every command
    counter: int = 0

    @property
    def work(self) -> Path:
        return self.base / "work"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"

    @property
    def state(self) -> Path:
        return self.base / ".state"


class LocalSandboxClient:
    """Async local sandbox backend mirroring prime-sandboxes' ``AsyncSandboxClient``.

    Args:
        root: directory holding the sandboxes (see :func:`default_root`).
        clock: monotonic clock used for sandbox lifetimes (inject one in tests).
        reap_interval: seconds between background checks for expired sandboxes;
            ``None`` disables the reaper thread (expiry is then checked on each call
            and by :meth:`reap_expired`).
        kill_grace: seconds between SIGTERM and SIGKILL when killing a sandbox.
        apply_rlimits: apply CPU / address-space / file-size rlimits to commands.
            Runtimes that reserve large virtual memory (JVM, Node) may need ``False``.
        max_output_bytes: tail of each background job stream kept in its status.
        max_read_bytes: largest file ``read_file`` returns whole
            (``SandboxFileTooLargeError`` beyond, as the real client).
        sweep_stale: at construction, remove sandboxes left in ``root`` by a process
            that no longer exists (e.g. a crashed training run).
        register_atexit: delete this client's sandboxes at interpreter exit.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        reap_interval: float | None = 1.0,
        kill_grace: float = 1.0,
        apply_rlimits: bool = True,
        max_output_bytes: int = 10 * 1024 * 1024,
        max_read_bytes: int = 10 * 1024 * 1024,
        sweep_stale: bool = True,
        register_atexit: bool = True,
    ) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.root = self.root.resolve()
        self._clock = clock
        self._reap_interval = reap_interval
        self._kill_grace = kill_grace
        self._apply_rlimits = apply_rlimits
        self._max_output_bytes = max_output_bytes
        self._max_read_bytes = max_read_bytes
        self._lock = threading.RLock()
        self._sandboxes: dict[str, _LocalSandbox] = {}
        self._destroying: dict[str, _LocalSandbox] = {}
        # Ids of deleted/expired sandboxes, so later calls fail like the real client's.
        self._gone: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        if sweep_stale:
            self.sweep_stale()
        if register_atexit:
            ref = weakref.ref(self)

            def _at_exit() -> None:
                client = ref()
                if client is not None:
                    client.delete_all()

            atexit.register(_at_exit)

    # ------------------------------------------------------------------ lifecycle

    async def create(self, request: CreateSandboxRequest) -> Sandbox:
        """Create a sandbox: a fresh directory, seeded from a local image if one is named.

        A local image that cannot be read leaves the sandbox in status ``ERROR`` and
        :meth:`wait_for_creation` raises ``SandboxImagePullError``, as for a failed pull.
        """
        sandbox_id = f"local-{uuid.uuid4().hex[:20]}"
        base = self.root / sandbox_id
        now = datetime.now(UTC)
        sb = _LocalSandbox(
            id=sandbox_id,
            request=request,
            base=base,
            created_at=now,
            deadline=self._clock() + request.timeout_minutes * 60,
        )
        try:
            self._make_dirs(sb)
        except OSError as e:  # as the real API reports a failed create
            raise APIError(f"Create failed: {e.__class__.__name__}: {e}") from e
        # Registered before any await: a cancelled create() still leaves nothing behind
        # after delete_all()/teardown() or the sandbox's lifetime.
        with self._lock:
            self._sandboxes[sandbox_id] = sb
        self._start_reaper()
        source = _local_image_path(request.docker_image)
        if source is not None:
            await asyncio.to_thread(self._seed, sb, source)
        if sb.dead:  # deleted while being seeded
            shutil.rmtree(sb.base, ignore_errors=True)
            self._raise_missing(sandbox_id)
        if sb.status == "RUNNING":
            self._start_main_command(sb)
        logger.debug("Created local sandbox %s at %s", sandbox_id, sb.work)
        return self._model(sb)

    async def get(self, sandbox_id: str) -> Sandbox:
        """Return the sandbox's model (status ``RUNNING`` or ``ERROR``)."""
        with self._lock:
            sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            self._raise_missing(sandbox_id)
        return self._model(sb)

    async def wait_for_creation(
        self,
        sandbox_id: str,
        max_attempts: int = 60,
        stability_checks: int = 1,
        image_build_timeout_seconds: int = 3000,
    ) -> None:
        """Return once the sandbox is running (local sandboxes are ready at creation)."""
        await self._running(sandbox_id)

    async def delete(self, sandbox_id: str) -> dict[str, Any]:
        """Kill every process of the sandbox and remove its directory.

        Deleting an already deleted or expired sandbox succeeds; an id this client never
        created raises ``APIError`` (HTTP 404), like the real API.
        """
        with self._lock:
            sb = self._sandboxes.get(sandbox_id)
            known = sb is not None or sandbox_id in self._gone
        if not known:
            raise APIError(f"HTTP 404: Sandbox {sandbox_id} not found")
        if sb is not None:
            await asyncio.to_thread(self._destroy, sb, "TERMINATED", None)
        return {"success": True, "sandbox_id": sandbox_id}

    async def bulk_delete(
        self,
        sandbox_ids: list[str] | None = None,
        labels: list[str] | None = None,
        team_id: str | None = None,
        user_id: str | None = None,
        all_users: bool = False,
    ) -> BulkDeleteSandboxResponse:
        """Delete the given sandboxes, or those carrying all of ``labels``."""
        if not sandbox_ids and not labels:
            raise APIError("HTTP 400: either sandbox_ids or labels must be provided")
        with self._lock:
            if sandbox_ids:
                targets = list(dict.fromkeys(sandbox_ids))
            else:
                wanted = set(labels or [])
                targets = [
                    sid for sid, sb in self._sandboxes.items() if wanted.issubset(sb.request.labels)
                ]
        succeeded: list[str] = []
        failed: list[dict[str, str]] = []
        for sid in targets:
            try:
                await self.delete(sid)
                succeeded.append(sid)
            except Exception as e:  # report per sandbox, as the real API does
                failed.append({"sandbox_id": sid, "error": str(e)})
        return BulkDeleteSandboxResponse(
            succeeded=succeeded,
            failed=failed,
            message=f"Deleted {len(succeeded)} sandbox(es), {len(failed)} failed",
        )

    def delete_all(self) -> None:
        """Synchronously kill and remove every sandbox of this client.

        Safe from ``atexit`` and signal handlers (no event loop needed) and idempotent.
        """
        with self._lock:
            victims = list(self._sandboxes.values()) + list(self._destroying.values())
        for sb in victims:
            try:
                self._destroy(sb, "TERMINATED", None)
            except Exception:  # keep going: one failure must not leak the others
                logger.exception("Failed to delete local sandbox %s", sb.id)

    def teardown(self, wait: bool = True) -> None:
        """Delete every sandbox and stop the reaper thread (sync, like
        ``ThreadedAsyncSandboxClient.teardown``)."""
        self._stop.set()
        self.delete_all()
        reaper = self._reaper
        if wait and reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=5)
        self._reaper = None

    def reap_expired(self) -> list[str]:
        """Kill and remove every sandbox past its ``timeout_minutes``; return their ids."""
        now = self._clock()
        with self._lock:
            expired = [sb for sb in self._sandboxes.values() if now >= sb.deadline]
        for sb in expired:
            self._destroy(sb, "TIMEOUT", "TIMEOUT")
        return [sb.id for sb in expired]

    def sweep_stale(self) -> list[str]:
        """Remove sandboxes in ``root`` whose owning process no longer exists."""
        removed: list[str] = []
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return removed
        for base in entries:
            meta_path = base / ".state" / "meta.json"
            try:
                owner = int(json.loads(meta_path.read_text())["owner_pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if _pid_alive(owner):
                continue
            pids = _sandbox_pids(base.name)
            _signal_pids(pids, signal.SIGKILL)
            shutil.rmtree(base, ignore_errors=True)
            removed.append(base.name)
        if removed:
            logger.info("Removed %d stale local sandbox(es) from %s", len(removed), self.root)
        return removed

    # ------------------------------------------------------------------ commands

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
        command's process group is killed), ``SandboxNotRunningError`` /
        ``SandboxTimeoutError`` when the sandbox is gone.
        """
        sb = await self._running(sandbox_id, command)
        effective_timeout = timeout if timeout is not None else _DEFAULT_EXEC_TIMEOUT
        n = self._next(sb)
        out_path = sb.state / f"exec_{n}.stdout"
        err_path = sb.state / f"exec_{n}.stderr"
        proc = self._spawn(sb, command, working_dir, env, user, out_path, err_path)
        try:
            rc = await _wait_proc(proc, effective_timeout)
            if rc is None:
                raise CommandTimeoutError(sandbox_id, command, effective_timeout)
        except BaseException:
            _kill_group(proc)  # cancelled or timed out: leave no runaway behind
            raise
        finally:
            with sb.lock:
                sb.procs.discard(proc)
        self._raise_if_dead(sb, command)
        try:
            stdout, _ = _read_tail(out_path, None)
            stderr, _ = _read_tail(err_path, None)
        finally:
            out_path.unlink(missing_ok=True)
            err_path.unlink(missing_ok=True)
        return CommandResponse(stdout=stdout, stderr=stderr, exit_code=_exit_code(rc))

    async def start_background_job(
        self,
        sandbox_id: str,
        command: str,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
    ) -> BackgroundJob:
        """Start ``command`` in the background; poll it with :meth:`get_background_job`.

        The returned handle's log/exit file paths are host paths in the sandbox's state
        directory (readable with :meth:`read_file`).
        """
        sb = await self._running(sandbox_id, command)
        job_id = uuid.uuid4().hex[:8]
        job = BackgroundJob(
            job_id=job_id,
            sandbox_id=sandbox_id,
            stdout_log_file=str(sb.state / f"job_{job_id}.stdout.log"),
            stderr_log_file=str(sb.state / f"job_{job_id}.stderr.log"),
            exit_file=str(sb.state / f"job_{job_id}.exit"),
        )
        proc = self._spawn(
            sb,
            command,
            working_dir,
            env,
            user,
            Path(job.stdout_log_file),
            Path(job.stderr_log_file),
        )
        with sb.lock:
            sb.jobs[job_id] = _Job(job=job, proc=proc)
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
        rc = entry.proc.poll()
        if rc is None:
            return BackgroundJobStatus(job_id=job.job_id, completed=False)
        with sb.lock:
            sb.procs.discard(entry.proc)
        exit_code = _exit_code(rc)
        with contextlib.suppress(OSError):
            Path(job.exit_file).write_text(f"{exit_code}\n")
        stdout, out_trunc = _read_tail(Path(job.stdout_log_file), self._max_output_bytes)
        stderr, err_trunc = _read_tail(Path(job.stderr_log_file), self._max_output_bytes)
        entry.status = BackgroundJobStatus(
            job_id=job.job_id,
            completed=True,
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
        )
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
        # Local polls are cheap: start fast, back off to at most poll_interval.
        delay = min(0.01, float(poll_interval))
        while True:
            status = await self.get_background_job(sandbox_id, job)
            if status.completed:
                return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommandTimeoutError(sandbox_id, command, timeout)
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, max(float(poll_interval), 0.01))

    # ------------------------------------------------------------------ files

    async def upload_file(
        self,
        sandbox_id: str,
        file_path: str,
        local_file_path: str,
        timeout: int | None = None,
    ) -> FileUploadResponse:
        """Copy a host file into the sandbox (parents created)."""
        if not os.path.exists(local_file_path):
            raise FileNotFoundError(f"Local file not found: {local_file_path}")
        sb = await self._running(sandbox_id)
        dest = self._resolve(sb, file_path)

        def copy() -> int:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local_file_path, dest)
            return dest.stat().st_size

        size = await self._file_op(copy, "Upload")
        return FileUploadResponse(
            success=True, path=file_path, size=size, timestamp=datetime.now(UTC)
        )

    async def upload_bytes(
        self,
        sandbox_id: str,
        file_path: str,
        file_bytes: bytes,
        filename: str,
        timeout: int | None = None,
    ) -> FileUploadResponse:
        """Write ``file_bytes`` to ``file_path`` in the sandbox (parents created)."""
        sb = await self._running(sandbox_id)
        dest = self._resolve(sb, file_path)

        def write() -> int:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(file_bytes)
            return len(file_bytes)

        size = await self._file_op(write, "Upload")
        return FileUploadResponse(
            success=True, path=file_path, size=size, timestamp=datetime.now(UTC)
        )

    async def download_file(
        self,
        sandbox_id: str,
        file_path: str,
        local_file_path: str,
        timeout: int | None = None,
    ) -> None:
        """Copy a sandbox file to the host."""
        sb = await self._running(sandbox_id)
        src = self._resolve(sb, file_path)

        def copy() -> None:
            if not src.is_file():
                raise APIError(f"Download failed: HTTP 404: {file_path} not found")
            parent = os.path.dirname(local_file_path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            shutil.copyfile(src, local_file_path)

        await self._file_op(copy, "Download")

    async def read_file(
        self,
        sandbox_id: str,
        file_path: str,
        timeout: int | None = None,
        offset: int | None = None,
        length: int | None = None,
    ) -> ReadFileResponse:
        """Read a text file (or a byte window of it) from the sandbox.

        Raises ``SandboxFileNotFoundError`` when missing and ``SandboxFileTooLargeError``
        when larger than ``max_read_bytes`` and no window is given.
        """
        sb = await self._running(sandbox_id)
        src = self._resolve(sb, file_path)

        def read() -> ReadFileResponse:
            if not src.is_file():
                raise SandboxFileNotFoundError(f"File not found: {file_path}")
            total = src.stat().st_size
            start = offset or 0
            if length is None and offset is None and total > self._max_read_bytes:
                raise SandboxFileTooLargeError(f"File too large to read: {file_path}")
            want = length if length is not None else self._max_read_bytes
            with src.open("rb") as f:
                f.seek(start)
                data = f.read(want)
            windowed = offset is not None or length is not None
            return ReadFileResponse(
                content=data.decode("utf-8", errors="replace"),
                size=len(data),
                total_size=total,
                offset=start if windowed else None,
                truncated=(start + len(data) < total) if windowed else None,
            )

        return await self._file_op(read, "Read file")

    # ------------------------------------------------------------------ internals

    def _make_dirs(self, sb: _LocalSandbox) -> None:
        """Create the sandbox's directories and its ownership record (for sweep_stale)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        sb.base.mkdir(mode=0o700)
        sb.work.mkdir()
        sb.tmp.mkdir()
        sb.state.mkdir()
        (sb.state / "meta.json").write_text(
            json.dumps({"owner_pid": os.getpid(), "name": sb.request.name})
        )

    def _seed(self, sb: _LocalSandbox, source: Path) -> None:
        """Fill the working dir from a local image (run in a thread)."""
        try:
            if source.is_dir():
                shutil.copytree(source, sb.work, symlinks=True, dirs_exist_ok=True)
            elif source.is_file() and tarfile.is_tarfile(source):
                with tarfile.open(source) as tar:
                    tar.extractall(sb.work, filter="data")
            else:
                raise FileNotFoundError(f"no directory or tar archive at {source}")
        except Exception as e:  # a bad image is the sandbox's failure, as with a pull error
            sb.status = "ERROR"
            sb.error_type = "IMAGE_PULL_FAILED"
            sb.error_message = f"Cannot use local image {sb.request.docker_image!r}: {e}"

    def _start_main_command(self, sb: _LocalSandbox) -> None:
        """Run a non-trivial ``start_command`` as the sandbox's long-lived process."""
        start = sb.request.start_command
        if isinstance(start, StartCommand):
            command = shlex.join([start.executable, *start.args])
        else:
            command = (start or "").strip()
        if command in _KEEPALIVE_COMMANDS:
            return
        self._spawn(sb, command, None, None, None, sb.state / "main.log", sb.state / "main.log")

    def _model(self, sb: _LocalSandbox) -> Sandbox:
        req = sb.request
        return Sandbox(
            id=sb.id,
            name=req.name,
            docker_image=req.docker_image,
            start_command=req.start_command,
            cpu_cores=req.cpu_cores,
            memory_gb=req.memory_gb,
            disk_size_gb=req.disk_size_gb,
            disk_mount_path=str(sb.work),
            gpu_count=req.gpu_count,
            gpu_type=req.gpu_type,
            vm=False,
            status=sb.status,
            timeout_minutes=req.timeout_minutes,
            idle_timeout_minutes=req.idle_timeout_minutes,
            environment_vars=req.environment_vars,
            advanced_configs=req.advanced_configs,
            labels=list(req.labels),
            created_at=sb.created_at,
            updated_at=sb.created_at,
            started_at=sb.created_at if sb.status == "RUNNING" else None,
            team_id=req.team_id,
            error_type=sb.error_type,
            error_message=sb.error_message,
        )

    async def _running(self, sandbox_id: str, command: str | None = None) -> _LocalSandbox:
        """Return the running sandbox, expiring it first if past its lifetime."""
        with self._lock:
            sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            self._raise_missing(sandbox_id, command)
        if sb.status == "ERROR":
            raise SandboxImagePullError(
                sandbox_id, "ERROR", sb.error_type, command=command, message=sb.error_message
            )
        if self._clock() >= sb.deadline:
            await asyncio.to_thread(self._destroy, sb, "TIMEOUT", "TIMEOUT")
            self._raise_missing(sandbox_id, command)
        return sb

    def _raise_missing(self, sandbox_id: str, command: str | None = None) -> Any:
        with self._lock:
            gone = self._gone.get(sandbox_id)
        if gone is None:
            raise APIError(f"HTTP 404: Sandbox {sandbox_id} not found")
        status, error_type = gone
        if error_type == "TIMEOUT":
            raise SandboxTimeoutError(
                sandbox_id,
                status,
                error_type,
                command=command,
                message=f"Sandbox {sandbox_id} exceeded its timeout and was terminated",
            )
        raise SandboxNotRunningError(sandbox_id, status, error_type, command=command)

    def _raise_if_dead(self, sb: _LocalSandbox, command: str | None) -> None:
        if sb.dead:
            self._raise_missing(sb.id, command)

    def _next(self, sb: _LocalSandbox) -> int:
        with sb.lock:
            sb.counter += 1
            return sb.counter

    def _resolve(self, sb: _LocalSandbox, file_path: str) -> Path:
        """Map a file-API path: relative -> working dir; absolute -> only inside the
        sandbox's own directory (never elsewhere on the host)."""
        path = Path(file_path)
        resolved = (sb.work / path) if not path.is_absolute() else path
        resolved = Path(os.path.normpath(resolved))
        if resolved != sb.base and sb.base not in resolved.parents:
            raise APIError(
                f"HTTP 403: local sandbox {sb.id}: path {file_path!r} is outside the sandbox "
                f"(relative paths resolve in {sb.work}; absolute paths are not remapped)"
            )
        return resolved

    async def _file_op(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except APIError:
            raise
        except OSError as e:  # the real client wraps transport/server failures in APIError
            raise APIError(f"{what} failed: {e.__class__.__name__}: {e}") from e

    def _process_env(self, sb: _LocalSandbox, env: dict[str, str] | None) -> dict[str, str]:
        """Only what the sandbox was given: never the host's environment."""
        py_bin = os.path.dirname(sys.executable)
        path = ":".join(
            dict.fromkeys(
                [py_bin, "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"]
                + ["/sbin", "/bin"]
            )
        )
        result = {
            "PATH": path,
            "HOME": str(sb.work),
            "SANDBOX_ROOT": str(sb.work),
            "TMPDIR": str(sb.tmp),
            "LANG": "C.UTF-8",
        }
        for extra in (sb.request.environment_vars, sb.request.secrets, env):
            for key, value in (extra or {}).items():
                if not _ENV_KEY.fullmatch(key):
                    raise ValueError(f"Invalid environment variable name: {key!r}")
                result[key] = str(value)
        result[MARKER_ENV_VAR] = sb.id  # last: cannot be overridden
        return result

    def _preexec(self, sb: _LocalSandbox) -> Callable[[], None] | None:
        if not self._apply_rlimits:
            return None
        req = sb.request
        limits: list[tuple[int, int]] = [(resource.RLIMIT_CORE, 0)]
        cpu_seconds = req.timeout_minutes * 60 * max(1, math.ceil(req.cpu_cores))
        limits.append((resource.RLIMIT_CPU, int(cpu_seconds)))
        if req.memory_gb > 0:
            limits.append((resource.RLIMIT_AS, int(req.memory_gb * _GiB)))
        if req.disk_size_gb > 0:
            limits.append((resource.RLIMIT_FSIZE, int(req.disk_size_gb * _GiB)))
        # Computed in the parent: the child only calls setrlimit (fork-safe).
        bounded: list[tuple[int, int]] = []
        for which, value in limits:
            _, hard = resource.getrlimit(which)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            bounded.append((which, value))

        def apply() -> None:
            for which, value in bounded:
                resource.setrlimit(which, (value, value))

        return apply

    def _spawn(
        self,
        sb: _LocalSandbox,
        command: str,
        working_dir: str | None,
        env: dict[str, str] | None,
        user: str | None,
        stdout_path: Path,
        stderr_path: Path,
    ) -> subprocess.Popen[bytes]:
        if user is not None:
            raise ValueError("The 'user' parameter is not supported by the local sandbox backend.")
        proc_env = self._process_env(sb, env)
        script = command
        if working_dir:
            # Like prime-sandboxes' background jobs: a missing dir fails the command.
            script = f"cd {shlex.quote(working_dir)} || exit 1\n{command}"
        with sb.lock:
            if sb.dead:
                self._raise_missing(sb.id, command)
            with open(stdout_path, "ab") as out, open(stderr_path, "ab") as err:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", script],
                    cwd=sb.work,
                    env=proc_env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,  # own session + process group: killable as one
                    preexec_fn=self._preexec(sb),
                    close_fds=True,
                )
            sb.procs.add(proc)
            sb.leaders.add(proc.pid)
        return proc

    def _start_reaper(self) -> None:
        if self._reap_interval is None:
            return
        with self._lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            self._stop.clear()
            interval = self._reap_interval
            ref = weakref.ref(self)
            stop = self._stop

            def loop() -> None:
                while not stop.wait(interval):
                    client = ref()
                    if client is None:
                        return
                    try:
                        client.reap_expired()
                    except Exception:
                        logger.exception("Local sandbox reaper failed")
                    del client

            self._reaper = threading.Thread(target=loop, name="local-sandbox-reaper", daemon=True)
            self._reaper.start()

    def _destroy(self, sb: _LocalSandbox, status: str, error_type: str | None) -> None:
        """Kill all of the sandbox's processes and remove its directory (idempotent)."""
        with self._lock:
            if self._sandboxes.pop(sb.id, None) is not None:
                self._gone[sb.id] = (status, error_type)
                while len(self._gone) > _MAX_TOMBSTONES:
                    self._gone.popitem(last=False)
            self._destroying[sb.id] = sb
        with sb.lock:
            sb.dead = True  # no new process can start from here on
            procs = list(sb.procs)
            leaders = set(sb.leaders)
        try:
            self._kill_processes(sb.id, procs, leaders)
            shutil.rmtree(sb.base, ignore_errors=True)
            if status == "TIMEOUT":
                logger.warning("Local sandbox %s exceeded its lifetime; killed", sb.id)
        finally:
            with self._lock:
                self._destroying.pop(sb.id, None)

    def _kill_processes(
        self, sandbox_id: str, procs: list[subprocess.Popen[bytes]], leaders: set[int]
    ) -> None:
        """SIGTERM the process groups of live leaders, SIGKILL what outlives the grace
        period, then one sweep of ``/proc`` for stragglers that left their group."""
        live = [p for p in procs if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._kill_grace
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.01)
        for proc in live:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:  # reap, so no zombie of ours stays behind
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
        # Orphans of a dead leader keep its session id (the kernel does not reuse a pid
        # that still names a session or group), and setsid escapees keep the marker.
        stragglers = _sandbox_pids(sandbox_id, leaders)
        _signal_pids(stragglers, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while stragglers and time.monotonic() < deadline:
            stragglers = {pid for pid in stragglers if _pid_running(pid)}
            if stragglers:
                time.sleep(0.01)


# ---------------------------------------------------------------------- helpers


def _local_image_path(docker_image: str) -> Path | None:
    """The local content a ``docker_image`` names, or ``None`` for a real image name."""
    for prefix in ("local:", "dir:"):
        if docker_image.startswith(prefix):
            return Path(docker_image[len(prefix) :]).expanduser()
    if os.path.isabs(docker_image):
        return Path(docker_image)
    return None


def _exit_code(rc: int) -> int:
    """Shell convention (128 + signal) for a process killed by a signal."""
    return 128 - rc if rc < 0 else rc


async def _wait_proc(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for ``proc`` without blocking the loop; ``None`` on timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        rc = proc.poll()
        if rc is not None:
            return rc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        await asyncio.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.025)


def _kill_group(proc: subprocess.Popen[bytes], settle_s: float = 1.0) -> None:
    """SIGKILL a command's whole process group and return once none of it still runs.

    The group is signalled even when its leader already exited: its children keep the
    group id (the kernel does not reuse it while they live). SIGKILL is delivered
    asynchronously, so wait (bounded) until no member is left running.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=2)
    deadline = time.monotonic() + settle_s
    while _group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.005)


def _group_running(pgid: int) -> bool:
    """Whether a live (non-zombie) process of process group ``pgid`` remains (Linux)."""
    for pid in _proc_pids():
        fields = _stat_fields(pid)
        if fields is not None and len(fields) > 2 and fields[0] != b"Z":
            if int(fields[2]) == pgid:
                return True
    return False


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_pids() -> Iterable[int]:
    try:
        names = os.listdir("/proc")
    except OSError:  # not Linux: process-group kills only
        return []
    return [int(n) for n in names if n.isdigit()]


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` fields after the command name: state ppid pgrp session ..."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def _pid_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is its new parent's to reap)."""
    fields = _stat_fields(pid)
    return fields is not None and bool(fields) and fields[0] != b"Z"


def _sandbox_pids(sandbox_id: str, sessions: Collection[int] = ()) -> set[int]:
    """Live processes of a sandbox (Linux): in one of ``sessions`` (as session or process
    group id) or carrying the sandbox's marker in their environment."""
    needle = f"{MARKER_ENV_VAR}={sandbox_id}".encode()
    session_ids = set(sessions)
    found: set[int] = set()
    me = os.getpid()
    for pid in _proc_pids():
        if pid == me:
            continue
        fields = _stat_fields(pid)
        if fields is None or len(fields) < 4 or fields[0] == b"Z":
            continue
        if int(fields[2]) in session_ids or int(fields[3]) in session_ids:
            found.add(pid)
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.add(pid)
    return found


def _signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
