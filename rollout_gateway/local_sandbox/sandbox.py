"""One local sandbox's record: its request, directories, confinement and processes."""

from __future__ import annotations

import os
import re
import shlex
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from prime_sandboxes import BackgroundJob, BackgroundJobStatus, CreateSandboxRequest, Sandbox

from rollout_gateway.local_sandbox.cgroups import SandboxCgroup
from rollout_gateway.local_sandbox.files import Anchor
from rollout_gateway.local_sandbox.isolation import Confinement, IsolationMode
from rollout_gateway.local_sandbox.layout import SandboxDirs
from rollout_gateway.local_sandbox.limits import SandboxLimits
from rollout_gateway.local_sandbox.processes import MARKER_ENV_VAR
from rollout_gateway.local_sandbox.uids import UidLease

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Job:
    """A background job and its process (status cached once completed)."""

    job: BackgroundJob
    proc: object  # subprocess.Popen[bytes]
    status: BackgroundJobStatus | None = None


@dataclass
class LocalSandbox:
    """Everything the client tracks about one sandbox."""

    id: str
    request: CreateSandboxRequest
    dirs: SandboxDirs
    created_at: datetime
    deadline: float
    mode: IsolationMode
    lease: UidLease | None = None
    lock_fd: int | None = None
    status: str = "RUNNING"
    error_type: str | None = None
    error_message: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Held while the sandbox is made (directories, file system, cgroups, image): its
    #: destruction waits for it, so nothing is made after the sandbox was removed.
    setup_lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False
    procs: set[object] = field(default_factory=set)
    jobs: dict[str, Job] = field(default_factory=dict)
    leaders: set[int] = field(default_factory=set)  # pid (= session id) of every command
    counter: int = 0
    limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(None, None, None, None))
    #: Its cgroups (where the host offers them) and its own file system's image, if any.
    cgroup: SandboxCgroup | None = None
    disk_image: Path | None = None
    #: Why the watchdog stopped it (a limit reached), once it did, and the commands that
    #: were running then (their leaders' pids).
    breach: str | None = None
    stopped_leaders: set[int] = field(default_factory=set)

    @property
    def work(self) -> Path:
        return self.dirs.work

    @property
    def owner(self) -> tuple[int, int] | None:
        """(uid, gid) the sandbox's files and processes belong to, when not the host's."""
        return (self.lease.uid, self.lease.gid) if self.lease is not None else None

    def next_number(self) -> int:
        with self.lock:
            self.counter += 1
            return self.counter

    def confinement(
        self,
        read_only: tuple[Path, ...],
        read_only_at: tuple[tuple[Path, Path], ...] = (),
    ) -> Confinement:
        owner = self.owner
        return Confinement(
            mode=self.mode,
            work=self.dirs.work,
            tmp=self.dirs.tmp,
            uid=owner[0] if owner else None,
            gid=owner[1] if owner else None,
            read_only=read_only if self.mode is IsolationMode.BWRAP else (),
            read_only_at=read_only_at if self.mode is IsolationMode.BWRAP else (),
        )

    def anchors(self) -> tuple[Anchor, list[Anchor]]:
        """(default anchor, all anchors) of file-API paths."""
        owner_uid = self.owner[0] if self.owner else None
        work = Anchor(self.dirs.work, owner_uid)
        tmp = Anchor(self.dirs.tmp, owner_uid)
        state = Anchor(self.dirs.state, os.geteuid())
        return work, [work, tmp, state]

    def environment(self, env: dict[str, str] | None) -> dict[str, str]:
        """Only what the sandbox was given: never the host's environment."""
        py_bin = os.path.dirname(sys.executable)
        path = ":".join(
            dict.fromkeys([py_bin, "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"])
        )
        result = {
            "PATH": f"{path}:/sbin:/bin",
            "HOME": str(self.dirs.work),
            "SANDBOX_ROOT": str(self.dirs.work),
            "TMPDIR": str(self.dirs.tmp),
            "LANG": "C.UTF-8",
        }
        for extra in (self.request.environment_vars, self.request.secrets, env):
            for key, value in (extra or {}).items():
                if not _ENV_KEY.fullmatch(key):
                    raise ValueError(f"Invalid environment variable name: {key!r}")
                result[key] = str(value)
        result[MARKER_ENV_VAR] = self.id  # last: cannot be overridden
        return result

    def model(self) -> Sandbox:
        """The prime-sandboxes ``Sandbox`` model of this sandbox."""
        req = self.request
        # By field name (the model also accepts its camelCase API aliases).
        return Sandbox.model_validate(
            {
                "id": self.id,
                "name": req.name,
                "docker_image": req.docker_image,
                "start_command": req.start_command,
                "cpu_cores": req.cpu_cores,
                "memory_gb": req.memory_gb,
                "disk_size_gb": req.disk_size_gb,
                "disk_mount_path": str(self.dirs.work),
                "gpu_count": req.gpu_count,
                "gpu_type": req.gpu_type,
                "vm": False,
                "status": self.status,
                "timeout_minutes": req.timeout_minutes,
                "idle_timeout_minutes": req.idle_timeout_minutes,
                "environment_vars": req.environment_vars,
                "advanced_configs": req.advanced_configs,
                "labels": list(req.labels),
                "created_at": self.created_at,
                "updated_at": self.created_at,
                "started_at": self.created_at if self.status == "RUNNING" else None,
                "team_id": req.team_id,
                "error_type": self.error_type,
                "error_message": self.error_message,
            }
        )


def shell_script(command: str, working_dir: str | None) -> str:
    """``command`` run from ``working_dir`` (a missing dir fails it, like prime's jobs)."""
    if working_dir:
        return f"cd {shlex.quote(working_dir)} || exit 1\n{command}"
    return command


__all__ = ["Job", "LocalSandbox", "shell_script"]
