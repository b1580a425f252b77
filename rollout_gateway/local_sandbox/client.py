"""``LocalSandboxClient``: prime-sandboxes' async client interface on local sandboxes.

An async drop-in for the ``sandbox_client`` that ``vf.CliAgentEnv`` / ``SandboxMixin`` use:
same method names, signatures, return models and exception types, so the mixin and
verifiers do not know which backend runs. Containment comes from the isolation mode
(:mod:`rollout_gateway.local_sandbox.isolation`), chosen once per client.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shlex
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from prime_sandboxes import (
    APIError,
    BackgroundJob,
    BackgroundJobStatus,
    BulkDeleteSandboxResponse,
    CommandResponse,
    CommandTimeoutError,
    CreateSandboxRequest,
    Sandbox,
    SandboxImagePullError,
    SandboxNotRunningError,
    SandboxTimeoutError,
    StartCommand,
)

from rollout_gateway.local_sandbox import layout, processes, uids
from rollout_gateway.local_sandbox.file_api import SandboxFileAPI
from rollout_gateway.local_sandbox.isolation import IsolationMode, choose_mode, python_dirs
from rollout_gateway.local_sandbox.sandbox import Job, LocalSandbox, shell_script
from rollout_gateway.local_sandbox.seeding import local_image_path, seed

logger = logging.getLogger(__name__)

ROOT_ENV_VAR = "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT"
"""Environment variable naming the directory under which sandboxes are created."""

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


class LocalSandboxClient(SandboxFileAPI):
    """Async local sandbox backend mirroring prime-sandboxes' ``AsyncSandboxClient``.

    Args:
        root: directory holding the sandboxes (see :func:`default_root`).
        isolation: ``"auto"`` (default: ``$ROLLOUT_GATEWAY_LOCAL_SANDBOX_ISOLATION`` or the
            strongest mode available), ``"bwrap"``, ``"unshare"``, ``"uid"``, or
            ``"process-group"`` (no containment: explicit opt-in only). The mode in use
            is :attr:`isolation`.
        clock: monotonic clock used for sandbox lifetimes (inject one in tests).
        reap_interval: seconds between background checks for expired sandboxes;
            ``None`` disables the reaper thread.
        kill_grace: seconds between SIGTERM and SIGKILL when killing a sandbox.
        apply_rlimits: apply CPU / address-space / file-size rlimits to commands.
        max_output_bytes: tail of each background job stream kept in its status.
        max_read_bytes: largest file ``read_file`` returns whole.
        sweep_stale: at construction, remove sandboxes whose owning client is gone.
        register_atexit: delete this client's sandboxes at interpreter exit.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        isolation: str | IsolationMode | None = None,
        clock: Callable[[], float] = time.monotonic,
        reap_interval: float | None = 1.0,
        kill_grace: float = 1.0,
        apply_rlimits: bool = True,
        max_output_bytes: int = 10 * 1024 * 1024,
        max_read_bytes: int = 10 * 1024 * 1024,
        sweep_stale: bool = True,
        register_atexit: bool = True,
    ) -> None:
        self.isolation: IsolationMode = choose_mode(isolation)
        traversable = self.isolation in (IsolationMode.UNSHARE, IsolationMode.UID)
        self.root = layout.prepare_root(
            Path(root) if root is not None else default_root(), traversable
        )
        self._traversable = traversable
        self._read_only = python_dirs()
        self._clock = clock
        self._reap_interval = reap_interval
        self._kill_grace = kill_grace
        self._apply_rlimits = apply_rlimits
        self._max_output_bytes = max_output_bytes
        self._max_read_bytes = max_read_bytes
        self._lock = threading.RLock()
        self._sandboxes: dict[str, LocalSandbox] = {}
        self._destroying: dict[str, LocalSandbox] = {}
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
        """Create a sandbox: fresh directories (and uid), seeded from a local image if named.

        A local image that cannot be read leaves the sandbox in status ``ERROR`` and
        :meth:`wait_for_creation` raises ``SandboxImagePullError``, as for a failed pull.
        """
        sandbox_id = f"local-{uuid.uuid4().hex[:20]}"
        sb = LocalSandbox(
            id=sandbox_id,
            request=request,
            dirs=layout.SandboxDirs(self.root / sandbox_id),
            created_at=datetime.now(UTC),
            deadline=self._clock() + request.timeout_minutes * 60,
            mode=self.isolation,
        )
        # Registered before any await: a cancelled create() still leaves nothing behind.
        with self._lock:
            self._sandboxes[sandbox_id] = sb
        try:
            await asyncio.to_thread(self._prepare, sb)
        except BaseException as e:
            await asyncio.shield(asyncio.to_thread(self._destroy, sb, "ERROR", None))
            if isinstance(e, OSError | RuntimeError):  # as the real API reports a failed create
                raise APIError(f"Create failed: {e.__class__.__name__}: {e}") from e
            raise
        self._start_reaper()
        if sb.dead:  # deleted while being prepared
            self._raise_missing(sandbox_id)
        if sb.status == "RUNNING":
            await self._start_main_command(sb)
        logger.debug("Created local sandbox %s (%s) at %s", sandbox_id, sb.mode, sb.work)
        return sb.model()

    def _prepare(self, sb: LocalSandbox) -> None:
        """Claim the uid, make the directories, seed the image (blocking: in a thread)."""
        if sb.mode.uses_sandbox_uid:
            sb.lease = uids.claim_uid()
        meta = {"mode": str(sb.mode), "uid": sb.lease.uid if sb.lease else None}
        sb.lock_fd = layout.create_dirs(sb.dirs, sb.owner, meta, self._traversable)
        source = local_image_path(sb.request.docker_image)
        if source is not None:
            error = seed(source, sb.work)
            if error is not None:
                sb.status, sb.error_type = "ERROR", "IMAGE_PULL_FAILED"
                sb.error_message = f"Cannot use local image {sb.request.docker_image!r}: {error}"
            elif sb.owner is not None:
                layout.chown_tree(sb.work, sb.owner)

    async def get(self, sandbox_id: str) -> Sandbox:
        """Return the sandbox's model (status ``RUNNING`` or ``ERROR``)."""
        with self._lock:
            sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            self._raise_missing(sandbox_id)
        return sb.model()

    def isolation_of(self, sandbox_id: str) -> IsolationMode:
        """The isolation mode a sandbox of this client runs in."""
        return self.isolation

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
        """Kill every process of the sandbox and remove its directories.

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
        """Remove sandboxes in ``root`` whose owning client is gone (see ``layout``)."""
        return layout.sweep_stale(self.root)

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
        self._raise_if_dead(sb, command)

        def collect() -> tuple[str, str]:
            try:
                return _read_tail(out_path, None)[0], _read_tail(err_path, None)[0]
            finally:
                out_path.unlink(missing_ok=True)
                err_path.unlink(missing_ok=True)

        stdout, stderr = await asyncio.to_thread(collect)
        return CommandResponse(stdout=stdout, stderr=stderr, exit_code=processes.exit_code(rc))

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
                stderr=stderr,
                stdout_truncated=out_trunc,
                stderr_truncated=err_trunc,
            )

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

    # ------------------------------------------------------------------ internals

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

    async def _running(self, sandbox_id: str, command: str | None = None) -> LocalSandbox:
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

    def _raise_missing(self, sandbox_id: str, command: str | None = None) -> NoReturn:
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

    def _raise_if_dead(self, sb: LocalSandbox, command: str | None) -> None:
        if sb.dead:
            self._raise_missing(sb.id, command)

    async def _spawn(
        self,
        sb: LocalSandbox,
        command: str,
        working_dir: str | None,
        env: dict[str, str] | None,
        user: str | None,
        stdout_path: Path,
        stderr_path: Path,
    ) -> Any:
        if user is not None:
            raise ValueError("The 'user' parameter is not supported by the local sandbox backend.")
        proc_env = sb.environment(env)
        req = sb.request
        limits = (
            processes.rlimit_args(
                timeout_minutes=req.timeout_minutes,
                cpu_cores=req.cpu_cores,
                memory_gb=req.memory_gb,
                disk_size_gb=req.disk_size_gb,
            )
            if self._apply_rlimits
            else []
        )
        confinement = sb.confinement(self._read_only)
        script = shell_script(command, working_dir)

        def start() -> Any:
            with sb.lock:  # no process starts once the sandbox is being destroyed
                if sb.dead:
                    self._raise_missing(sb.id, command)
                proc = processes.spawn(
                    confinement, script, proc_env, stdout_path, stderr_path, limits
                )
                sb.procs.add(proc)
                sb.leaders.add(proc.pid)
            return proc

        return await asyncio.to_thread(start)

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

    def _destroy(self, sb: LocalSandbox, status: str, error_type: str | None) -> None:
        """Kill all of the sandbox's processes, remove its directories, free its uid."""
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
            processes.kill_leaders(procs, self._kill_grace)  # type: ignore[arg-type]
            # What is left in the commands' sessions: e.g. a namespace's init still being
            # set up (still root, not yet the sandbox's uid) when its launcher died.
            processes.kill_marked(sb.id, leaders)
            if sb.lease is not None:
                sb.lease.release()  # kill -1 as the sandbox's uid, then free the uid
            shutil.rmtree(sb.dirs.base, ignore_errors=True)
            if sb.lock_fd is not None:
                fd, sb.lock_fd = sb.lock_fd, None
                os.close(fd)
            if status == "TIMEOUT":
                logger.warning("Local sandbox %s exceeded its lifetime; killed", sb.id)
        finally:
            with self._lock:
                self._destroying.pop(sb.id, None)


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


__all__ = ["LocalSandboxClient", "ROOT_ENV_VAR", "default_root"]
