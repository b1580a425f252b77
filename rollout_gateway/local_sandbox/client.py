"""``LocalSandboxClient``: prime-sandboxes' async client interface on local sandboxes.

An async drop-in for the ``sandbox_client`` that ``vf.CliAgentEnv`` / ``SandboxMixin`` use:
same method names, signatures, return models and exception types, so the mixin and
verifiers do not know which backend runs. Containment comes from the isolation mode
(:mod:`rollout_gateway.local_sandbox.isolation`), chosen once per client.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prime_sandboxes import (
    APIError,
    BulkDeleteSandboxResponse,
    CreateSandboxRequest,
    Sandbox,
    SandboxImagePullError,
)

from rollout_gateway.local_sandbox import layout, limits
from rollout_gateway.local_sandbox.commands import SandboxCommandAPI
from rollout_gateway.local_sandbox.file_api import SandboxFileAPI
from rollout_gateway.local_sandbox.isolation import IsolationMode, choose_mode, python_dirs
from rollout_gateway.local_sandbox.provision import provision
from rollout_gateway.local_sandbox.registry import SandboxRegistry
from rollout_gateway.local_sandbox.sandbox import LocalSandbox
from rollout_gateway.local_sandbox.warden import Warden

logger = logging.getLogger(__name__)

ROOT_ENV_VAR = "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT"
"""Environment variable naming the directory under which sandboxes are created."""


def default_root() -> Path:
    """The sandbox root used when none is passed: ``$ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT``
    or ``<system temp dir>/rollout-gateway-sandboxes``."""
    env_root = os.environ.get(ROOT_ENV_VAR)
    if env_root:
        return Path(env_root)
    return Path(tempfile.gettempdir()) / "rollout-gateway-sandboxes"


#: Sandbox paths a read-only mount may not cover (the sandbox's own system and temp).
_SYSTEM_PATHS = ("/", "/usr", "/bin", "/sbin", "/lib", "/etc", "/proc", "/dev", "/tmp", "/run")


def _mounts_at(
    read_only_at: Mapping[str, str | os.PathLike[str]],
) -> tuple[tuple[Path, Path], ...]:
    """``read_only_at`` checked: (host directory, sandbox path) pairs."""
    mounts = []
    for where, host in read_only_at.items():
        path = Path(where)
        kernel = any(str(path).startswith(f"{top}/") for top in ("/proc", "/dev", "/sys"))
        if not path.is_absolute() or ".." in path.parts or str(path) in _SYSTEM_PATHS or kernel:
            raise ValueError(f"read_only_at: {where!r} is not a sandbox path it may cover")
        source = Path(host).resolve()
        if not source.is_dir():
            raise ValueError(f"read_only_at: {source} is not a directory")
        mounts.append((source, path))
    return tuple(mounts)


class LocalSandboxClient(SandboxCommandAPI, SandboxFileAPI):
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
        warden: from the first sandbox on, a warden process removes this client's
            sandboxes (and stops their processes) if this process dies without tearing
            down (``kill -9``, a crash): :mod:`~rollout_gateway.local_sandbox.warden`.
        pids_limit: processes (and threads) each sandbox may have at once (``create``'s
            ``pids`` overrides it per sandbox; ``None``: no limit).
        enforce_limits: give each sandbox its cgroups and its own file system where the
            host offers them (:mod:`~rollout_gateway.local_sandbox.limits`); the
            watchdog stops a sandbox past a limit either way.
        read_only: host directories every sandbox sees, read-only, at the same path
            (``bwrap`` mode mounts them; the other modes see the host's file system
            anyway): programs installed once per machine and shared by all sandboxes,
            such as the agent CLIs' cache (:mod:`rollout_gateway.agent_clis`). Each
            must be an existing directory or file (a file: e.g. a lock file an
            installer's ready check opens beside its directory).
        read_only_at: sandbox path -> host directory, each seen read-only by every
            sandbox at its sandbox path (``bwrap`` mode only; the path must be absolute
            and no system directory): a harness's install from the per-machine cache
            where its own ready check looks (``{"/var/tmp/vf-claude-code": ...}``,
            :mod:`~rollout_gateway.local_sandbox.harness_cache`).

    Each sandbox's memory, disk and CPU come from its request (``memory_gb``,
    ``disk_size_gb``, ``cpu_cores``); how this host enforces them:
    :meth:`limit_enforcement`.
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
        warden: bool = True,
        pids_limit: int | None = limits.DEFAULT_PIDS,
        enforce_limits: bool = True,
        read_only: Sequence[str | os.PathLike[str]] = (),
        read_only_at: Mapping[str, str | os.PathLike[str]] | None = None,
    ) -> None:
        shared = tuple(Path(path).resolve() for path in read_only)
        for path in shared:
            if not (path.is_dir() or path.is_file()):
                raise ValueError(f"read_only: {path} is not a directory or a file")
        self._read_only_at = _mounts_at(read_only_at or {})
        self.isolation: IsolationMode = choose_mode(isolation)
        traversable = self.isolation in (IsolationMode.UNSHARE, IsolationMode.UID)
        self.root = layout.prepare_root(
            Path(root) if root is not None else default_root(), traversable
        )
        self._traversable = traversable
        self._read_only = (*python_dirs(), *shared)
        self._clock = clock
        self._reap_interval = reap_interval
        self._apply_rlimits = apply_rlimits
        self._max_output_bytes = max_output_bytes
        self._max_read_bytes = max_read_bytes
        self._registry = SandboxRegistry(clock, kill_grace)
        self._pids_limit = pids_limit
        self._enforce_limits = enforce_limits
        self._warden = Warden(self.root) if warden else None
        if sweep_stale:
            self.sweep_stale()
        if register_atexit:
            ref = weakref.ref(self)

            def _at_exit() -> None:
                client = ref()
                if client is not None:
                    client.delete_all()
                    client._stand_down()

            atexit.register(_at_exit)

    # ------------------------------------------------------------------ lifecycle

    async def create(self, request: CreateSandboxRequest, *, pids: int | None = None) -> Sandbox:
        """Create a sandbox: fresh directories (and uid), seeded from a local image if named,
        with its limits (``pids``: a local extension, overriding ``pids_limit``).

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
            limits=limits.SandboxLimits.of(
                memory_gb=request.memory_gb,
                disk_size_gb=request.disk_size_gb,
                pids=pids if pids is not None else self._pids_limit,
                cpu_cores=request.cpu_cores,
            ),
        )
        if self._warden is not None:
            self._warden.ensure()
        # Registered before any await: a cancelled create() still leaves nothing behind.
        self._registry.add(sb)
        try:
            await asyncio.to_thread(self._prepare, sb)
        except BaseException as e:
            await asyncio.shield(asyncio.to_thread(self._registry.destroy, sb, "ERROR", None))
            if isinstance(e, OSError | RuntimeError):  # as the real API reports a failed create
                raise APIError(f"Create failed: {e.__class__.__name__}: {e}") from e
            raise
        if self._reap_interval is not None:
            self._registry.start_reaper(self._reap_interval)
        if sb.dead:  # deleted while being prepared
            self._registry.raise_missing(sandbox_id)
        if sb.status == "RUNNING":
            await self._start_main_command(sb)
        logger.debug("Created local sandbox %s (%s) at %s", sandbox_id, sb.mode, sb.work)
        return sb.model()

    def _prepare(self, sb: LocalSandbox) -> None:
        """Claim the uid, make the directories, seed the image (blocking: in a thread).

        Under the sandbox's setup lock, which its destruction waits for: a sandbox
        deleted (or torn down) while this runs is removed with all this makes, and one
        deleted before it starts is not made at all.
        """
        with sb.setup_lock:
            if not sb.dead:
                provision(
                    sb,
                    self.root,
                    enforce_limits=self._enforce_limits,
                    traversable=self._traversable,
                )

    async def get(self, sandbox_id: str) -> Sandbox:
        """Return the sandbox's model (status ``RUNNING`` or ``ERROR``)."""
        sb = self._registry.get(sandbox_id)
        if sb is None:
            self._registry.raise_missing(sandbox_id)
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
        sb = self._registry.get(sandbox_id)
        if sb is None and not self._registry.known(sandbox_id):
            raise APIError(f"HTTP 404: Sandbox {sandbox_id} not found")
        if sb is not None:
            await asyncio.to_thread(self._registry.destroy, sb, "TERMINATED", None)
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
        if sandbox_ids:
            targets = list(dict.fromkeys(sandbox_ids))
        else:
            targets = self._registry.with_labels(set(labels or []))
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

    def delete_sync(self, sandbox_id: str) -> None:
        """Kill every process of one sandbox and remove it, blocking (no event loop
        needed: for ``atexit`` and sync teardown paths); idempotent, unknown ids ignored."""
        sb = self._registry.get(sandbox_id)
        if sb is not None:
            self._registry.destroy(sb, "TERMINATED", None)

    def sandbox_dirs(self, sandbox_id: str) -> layout.SandboxDirs:
        """The host directories of a live sandbox (its working and temp directories are
        at the same paths inside it)."""
        sb = self._registry.get(sandbox_id)
        if sb is None:
            self._registry.raise_missing(sandbox_id)
        return sb.dirs

    def stop_processes(self, sandbox_id: str) -> None:
        """Kill every process of a sandbox and keep the sandbox (its files, for scoring).

        A local extension of the API: in the namespace modes each command has its own
        PID namespace, so a stop command run inside the sandbox cannot see the others;
        this stops them from the host, in every mode. Blocking: call it off the loop.
        """
        sb = self._registry.get(sandbox_id)
        if sb is None:
            self._registry.raise_missing(sandbox_id)
        self._registry.stop_processes(sb)

    def enforce_limits(self) -> list[str]:
        """Stop every sandbox past a resource limit now (the reaper thread does this every
        ``reap_interval``); the ids stopped."""
        return self._registry.enforce_limits()

    def limit_enforcement(self) -> dict[str, str]:
        """How this client's sandboxes' limits are enforced on this host, in words."""
        if not self._enforce_limits:
            return {"processes": "off", "memory": "off", "disk": "off", "cpu": "off"}
        return limits.enforcement(self.isolation.uses_sandbox_uid)

    def delete_all(self) -> None:
        """Synchronously kill and remove every sandbox of this client.

        Safe from ``atexit`` and signal handlers (no event loop needed) and idempotent.
        """
        self._registry.destroy_all()

    def teardown(self, wait: bool = True) -> None:
        """Delete every sandbox and stop the reaper thread (sync, like
        ``ThreadedAsyncSandboxClient.teardown``)."""
        reaper = self._registry.stop_reaper()
        self.delete_all()
        self._stand_down()
        if wait and reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=5)

    def _stand_down(self) -> None:
        if self._warden is not None:
            self._warden.stand_down()

    def reap_expired(self) -> list[str]:
        """Kill and remove every sandbox past its ``timeout_minutes``; return their ids."""
        return self._registry.reap_expired()

    def sweep_stale(self) -> list[str]:
        """Remove sandboxes in ``root`` whose owning client is gone (see ``layout``)."""
        return layout.sweep_stale(self.root)

    # ------------------------------------------------------------------ internals

    async def _running(self, sandbox_id: str, command: str | None = None) -> LocalSandbox:
        """Return the running sandbox, expiring it first if past its lifetime."""
        sb = self._registry.get(sandbox_id)
        if sb is None:
            self._registry.raise_missing(sandbox_id, command)
        if sb.status == "ERROR":
            raise SandboxImagePullError(
                sandbox_id, "ERROR", sb.error_type, command=command, message=sb.error_message
            )
        if self._registry.expired(sb):
            await asyncio.to_thread(self._registry.destroy, sb, "TIMEOUT", "TIMEOUT")
            self._registry.raise_missing(sandbox_id, command)
        return sb


__all__ = ["LocalSandboxClient", "ROOT_ENV_VAR", "default_root"]
