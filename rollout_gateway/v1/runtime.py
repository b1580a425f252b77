"""``LocalSandboxRuntime``: verifiers v1's ``Runtime`` contract on the project's local
sandboxes (:mod:`rollout_gateway.local_sandbox`).

One rollout, one sandbox: ``start()`` creates it (fresh working and temp directories, its
own uid on root hosts, its limits), every ``run``/``run_program``/``open_process``/
``run_background`` runs confined in it with only the environment the rollout gives, file
I/O never leaves it, and ``stop()`` kills every process it has and removes it. The
isolation mode is chosen once per process and root (``auto``: the strongest the host
offers); sandboxes of one mode and root share one
:class:`~rollout_gateway.local_sandbox.LocalSandboxClient` (its reaper, its stale sweep).

Selecting it: a config whose agent ``runtime`` is a :data:`~rollout_gateway.v1.RuntimeChoice`
(e.g. :class:`~rollout_gateway.v1.GatewayEnvConfig`, or
:class:`~rollout_gateway.v1.LocalSandboxAgentConfig` with ``vf.Agent``) and
``runtime.type = "local_sandbox"``.

verifiers 0.4 has no way to register a runtime type: :func:`install` adds the
``local_sandbox`` entry to v1's runtime table
(:func:`rollout_gateway.v1.internals.install_runtime_type` says why that is the one change
to v1's internals). Importing changes nothing; a :class:`LocalSandboxRuntimeConfig` calls
:func:`install` when it is made, so whatever selects the type (``--env.agent.runtime.type
local_sandbox``, TOML, code) has the entry before v1 can look it up. How a trace records
the runtime: :mod:`rollout_gateway.v1.runtime_record`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, cast

from prime_sandboxes import APIError, CreateSandboxRequest, SandboxFileNotFoundError
from pydantic import Field, field_validator
from pydantic_config import BaseConfig

from rollout_gateway.local_sandbox import (
    IsolationMode,
    LocalSandboxClient,
    LocalSandboxError,
    processes,
)
from rollout_gateway.local_sandbox.harness_cache import HarnessCache, HarnessInstallError
from rollout_gateway.v1.harness_python import HARNESS_PYTHON_ENV_VAR, python_prefix
from rollout_gateway.v1.internals import (
    BaseRuntimeInfo,
    ProgramResult,
    Runtime,
    RuntimeProcess,
    SandboxError,
    install_runtime_type,
)

logger = logging.getLogger(__name__)

#: ``execute_command``'s bound for v1's commands: none in practice (v1 bounds the agent's
#: time itself, and a cancelled command is killed with its process group).
_NO_TIMEOUT = 10 * 365 * 24 * 3600


# ---------------------------------------------------------------- the config

#: The isolation modes of the local sandboxes (``rollout_gateway.local_sandbox``), and
#: ``auto``: the strongest this host offers (never ``process-group``).
IsolationChoice = Literal["auto", "bwrap", "unshare", "uid", "process-group"]


class LocalSandboxRuntimeConfig(BaseConfig):
    """Run the harness in a contained local sandbox (``rollout_gateway.local_sandbox``).

    The same isolation modes and guarantees as the classic stack's local backend: a
    private working directory (``HOME``) and temp directory as the only writable places,
    its own uid on root hosts, no host environment, and enforced process, memory and
    disk limits where the host offers them (``rollout-gateway demo --help`` lists them).
    The network is the host's (agents reach the gateway over loopback). The task's
    ``resources`` (``cpu``, ``memory``, ``disk``) apply unless set here.
    """

    type: Literal["local_sandbox"] = "local_sandbox"
    isolation: IsolationChoice = "auto"
    """``auto`` (the strongest this host offers), ``bwrap``, ``unshare``, ``uid``, or
    ``process-group`` (no containment: explicit opt-in, with a warning)."""
    root: str | None = None
    """Directory holding the sandboxes (default ``$ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT`` or
    ``<temp dir>/rollout-gateway-sandboxes``)."""
    cpu: float | None = Field(None, gt=0)
    """CPU cores (CPU-time bound of each command; a CPU quota where the host offers
    cgroups). None: one core."""
    memory: float = Field(2.0, gt=0)
    """Memory in GB, for the whole sandbox."""
    disk: float = Field(5.0, gt=0)
    """Disk in GB: everything the sandbox writes (working and temp directories)."""
    pids: int = Field(1024, gt=0)
    """Processes (and threads) the sandbox may have at once."""
    image: str | None = None
    """A local image seeding the working directory: ``local:<dir or .tar[.gz]>``,
    ``dir:<dir>`` or an absolute path. A container image name is refused (a local
    sandbox runs the host's programs: use the docker or prime runtime for images)."""
    timeout_minutes: float = Field(24 * 60, gt=0)
    """Longest lifetime of one sandbox; past it the sandbox is killed and removed (v1's
    own timeouts bound the agent first)."""
    read_only: list[str] = Field(default_factory=list)
    """Host directories (or files) every sandbox sees read-only at the same path: what harnesses
    install once per machine, shared by all rollouts (e.g. the agent CLIs' cache of
    :mod:`rollout_gateway.agent_clis`) instead of installed in each sandbox."""
    read_only_at: dict[str, str] = Field(default_factory=dict)
    """Sandbox path -> host directory, seen read-only by every sandbox at that path: a
    harness's install from the per-machine cache where its own ready check looks (e.g.
    ``{"/var/tmp/vf-claude-code": "<cache>/dirs/claude_code"}``,
    :meth:`~rollout_gateway.local_sandbox.harness_cache.HarnessCache.directory`)."""
    harness_cache: bool = True
    """Install harnesses' PEP 723 scripts (``prepare_uv_script``: bash, mini_swe_agent,
    terminus_2, ...) once per machine on the host, into a cache every sandbox sees
    read-only (:mod:`rollout_gateway.local_sandbox.harness_cache`). False: v1's own
    install, in each sandbox (needs ``uv`` and network access inside it)."""
    harness_cache_root: str | None = None
    """The cache's directory (default ``$ROLLOUT_GATEWAY_HARNESS_CACHE`` or
    ``~/.cache/rollout-gateway/harnesses``)."""
    harness_python: str | None = Field(
        default_factory=lambda: os.environ.get(HARNESS_PYTHON_ENV_VAR) or None
    )
    """A Python on the host that the harness cache builds scripts' environments on
    (uv's ``--python``), for a harness whose ``requires-python`` the host's Python does
    not meet where uv cannot download one (``terminus_2``: Harbor needs >= 3.12); every
    sandbox sees its installation read-only. Default ``$ROLLOUT_GATEWAY_HARNESS_PYTHON``;
    None: uv's choice. :func:`rollout_gateway.v1.harness_python.find_python` finds one."""

    @field_validator("image")
    @classmethod
    def _local_image(cls, image: str | None) -> str | None:
        from rollout_gateway.local_sandbox.seeding import local_image_path

        if image is not None and local_image_path(image) is None:
            raise ValueError(
                f"the local_sandbox runtime cannot run container image {image!r}: it runs "
                "the host's programs (use the docker or prime runtime for images, or a "
                "local image: local:<directory or .tar>)"
            )
        return image

    def model_post_init(self, context: Any, /) -> None:
        """The config selects the runtime: v1 can resolve it from now (see :func:`install`)."""
        super().model_post_init(context)
        install()


class LocalSandboxRuntimeInfo(LocalSandboxRuntimeConfig, BaseRuntimeInfo):
    """What a trace records about the local sandbox its rollout ran in (``id``: the
    sandbox id)."""


class LocalSandboxStartError(SandboxError):
    """The local sandbox cannot start on this host: the isolation mode it tried is
    unavailable, or the sandbox root is unusable. Raised before any rollout runs (by
    :func:`check_local_sandbox`, which the gateway env calls when it starts serving) and
    by ``start()``; the message names the mode and what to do."""


# ---------------------------------------------------------------- shared clients

_ClientKey = tuple[str | None, str, tuple[str, ...], tuple[tuple[str, str], ...]]
_clients: dict[_ClientKey, LocalSandboxClient] = {}
_clients_lock = threading.Lock()
_caches: dict[str | None, HarnessCache] = {}


def _harness_cache(config: LocalSandboxRuntimeConfig) -> HarnessCache | None:
    """The per-machine harness cache ``config`` uses (made on first use), or None."""
    if not config.harness_cache:
        return None
    with _clients_lock:
        cache = _caches.get(config.harness_cache_root)
        if cache is None:
            cache = _caches[config.harness_cache_root] = HarnessCache(config.harness_cache_root)
        return cache


def _client(config: LocalSandboxRuntimeConfig) -> LocalSandboxClient:
    """The process-wide client of ``config``'s root and isolation (blocking: probes the
    host the first time)."""
    cache = _harness_cache(config)
    read_only = [*config.read_only, *([str(cache.root)] if cache is not None else [])]
    if cache is not None and config.harness_python is not None:
        try:
            read_only.append(str(python_prefix(config.harness_python)))
        except ValueError as e:
            raise LocalSandboxStartError(str(e)) from e
    key = (
        config.root,
        config.isolation,
        tuple(read_only),
        tuple(sorted(config.read_only_at.items())),
    )
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            try:
                client = LocalSandboxClient(
                    config.root,
                    isolation=config.isolation,
                    read_only=read_only,
                    read_only_at=config.read_only_at,
                )
            except (LocalSandboxError, ValueError) as e:
                raise LocalSandboxStartError(str(e)) from e
            except OSError as e:
                raise LocalSandboxStartError(
                    f"local sandboxes cannot be prepared (isolation {config.isolation}): {e}"
                ) from e
            _clients[key] = client
        return client


async def check_local_sandbox(config: LocalSandboxRuntimeConfig) -> str:
    """Fail fast: prepare ``config``'s sandboxes (probe the isolation mode, make the root);
    the isolation mode in use. Raises :class:`LocalSandboxStartError` saying what to do."""
    client = await asyncio.to_thread(_client, config)
    return str(client.isolation)


# ---------------------------------------------------------------- live processes


async def _read_stream(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(64 * 1024):
        yield chunk


class LocalSandboxProcess(RuntimeProcess):
    """A live process in a local sandbox: its pipes as asyncio streams, its signals to
    its whole process group."""

    def __init__(
        self,
        proc: Any,
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
    ) -> None:
        self._proc = proc
        self._stdin = stdin
        self.stdout = _read_stream(stdout)
        self.stderr = _read_stream(stderr)

    @classmethod
    async def attach(cls, proc: Any) -> LocalSandboxProcess:
        """Wrap a ``subprocess.Popen`` started with three pipes."""
        loop = asyncio.get_running_loop()
        readers = []
        for pipe in (proc.stdout, proc.stderr):
            reader = asyncio.StreamReader(limit=2**20)
            protocol = asyncio.StreamReaderProtocol(reader)
            await loop.connect_read_pipe(lambda p=protocol: p, pipe)  # type: ignore[misc]
            readers.append(reader)
        transport, flow = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, proc.stdin
        )
        writer = asyncio.StreamWriter(transport, flow, None, loop)
        return cls(proc, writer, readers[0], readers[1])

    async def write(self, data: bytes) -> None:
        self._stdin.write(data)
        await self._stdin.drain()

    async def wait(self) -> int:
        rc = await processes.wait_proc(self._proc, float("inf"))
        assert rc is not None
        return rc

    async def poll(self) -> int | None:
        rc: int | None = self._proc.poll()
        return rc

    async def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    async def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)


# ---------------------------------------------------------------- the runtime


class LocalSandboxRuntime(Runtime):
    """v1 ``Runtime`` running each rollout in its own contained local sandbox.

    Paths: relative paths are in the sandbox's working directory (its ``HOME`` and the
    commands' working directory); absolute ones only inside the sandbox's working or
    temp directory (``$TMPDIR``); symlinks and ``..`` never lead out.
    """

    is_local = True

    def __init__(self, config: LocalSandboxRuntimeConfig, name: str | None = None) -> None:
        super().__init__(name)
        self.config = config
        self.info = LocalSandboxRuntimeInfo(**config.model_dump())
        self._client: LocalSandboxClient | None = None
        self.sandbox_id: str | None = None
        #: The sandbox's working directory (host path; the same path inside the sandbox).
        self.workdir: Path | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the sandbox (raises :class:`LocalSandboxStartError` when it cannot)."""
        client = await asyncio.to_thread(_client, self.config)
        self._client = client
        config = self.config
        request = CreateSandboxRequest.model_validate(
            {
                "name": self.name,
                "docker_image": config.image or "local",
                "cpu_cores": config.cpu or 1.0,
                "memory_gb": config.memory,
                "disk_size_gb": config.disk,
                "timeout_minutes": max(1, int(config.timeout_minutes)),
                "labels": ["verifiers-v1"],
            }
        )
        try:
            sandbox = await client.create(request, pids=config.pids)
            # Recorded before the wait: a failed start still reaches stop() with it.
            self.sandbox_id = sandbox.id
            self.info.id = sandbox.id
            self.info.isolation = cast(IsolationChoice, str(client.isolation))
            await client.wait_for_creation(sandbox.id)
        except (APIError, LocalSandboxError) as e:
            raise LocalSandboxStartError(
                f"local sandbox (isolation {client.isolation}) failed to start: {e}"
            ) from e
        dirs = client.sandbox_dirs(sandbox.id)
        self.workdir = dirs.work
        # Content-addressed scripts (prepare_uv_script) live in the sandbox's own temp
        # directory: writable by it, gone with it.
        self.scripts_dir = str(dirs.tmp / "vf-scripts")
        logger.debug("local sandbox %s (%s) for %s", sandbox.id, client.isolation, self.name)

    def cleanup(self) -> None:
        """Kill every process of the sandbox and remove it (sync, idempotent)."""
        client, sandbox_id = self._client, self.sandbox_id
        if client is not None and sandbox_id is not None:
            client.delete_sync(sandbox_id)

    # ------------------------------------------------------------ commands

    def _running(self) -> tuple[LocalSandboxClient, str]:
        if self._client is None or self.sandbox_id is None:
            raise SandboxError("local sandbox runtime is not started")
        return self._client, self.sandbox_id

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        """Run ``argv`` to its end in the sandbox (killed with its process group if the
        caller is cancelled)."""
        client, sandbox_id = self._running()
        try:
            response = await client.execute_command(
                sandbox_id, shlex.join(argv), env=self.process_env(env), timeout=_NO_TIMEOUT
            )
        except APIError as e:
            raise SandboxError(f"local sandbox {sandbox_id}: {e}") from e
        return ProgramResult(response.exit_code, response.stdout, response.stderr)

    async def open_process(self, argv: list[str], env: dict[str, str]) -> RuntimeProcess:
        """Start ``argv`` with stdin, stdout and stderr as pipes."""
        client, sandbox_id = self._running()
        try:
            proc = await client.open_process(
                sandbox_id, shlex.join(argv), env=self.process_env(env)
            )
        except APIError as e:
            raise SandboxError(f"local sandbox {sandbox_id}: {e}") from e
        return await LocalSandboxProcess.attach(proc)

    async def run_background(self, argv: list[str], env: dict[str, str], log: str) -> None:
        """Start ``argv`` in the background, output to ``log`` (a sandbox path); it runs
        until the runtime stops."""
        client, sandbox_id = self._running()
        command = f"exec {shlex.join(argv)} > {shlex.quote(log)} 2>&1 < /dev/null"
        try:
            await client.start_background_job(sandbox_id, command, env=self.process_env(env))
        except APIError as e:
            raise SandboxError(f"local sandbox {sandbox_id}: {e}") from e

    # ------------------------------------------------------------ installs

    async def prepare_uv_script(
        self,
        script: str | bytes,
        env: dict[str, str] | None = None,
        *,
        activate: bool = True,
    ) -> list[str]:
        """v1's contract (an argv running the PEP 723 ``script``), from the per-machine
        harness cache: installed on the host the first time any sandbox needs it, then
        run read-only by every sandbox (no ``uv``, network or certificates inside it).
        ``env`` (the harness's) applies when the program runs, not to the install.
        With ``harness_cache = false``: v1's own per-sandbox install."""
        cache = _harness_cache(self.config)
        if cache is None:
            return await super().prepare_uv_script(script, env, activate=activate)
        client, _ = self._running()
        python = self.config.harness_python
        if client.isolation in (IsolationMode.UID, IsolationMode.UNSHARE):
            _check_traversable(cache.root)
            if python is not None:
                _check_traversable(python_prefix(python))
        data = script.encode() if isinstance(script, str) else script
        try:
            program = await asyncio.to_thread(cache.uv_script, data, python)
        except HarnessInstallError as e:
            raise RuntimeError(f"failed to prepare uv script: {e}") from e
        interpreter, path = str(program.interpreter), str(program.script)
        if not activate:
            return [interpreter, path]
        # As v1's own: the script's environment first on PATH, for the program's children.
        venv = str(program.interpreter.parent.parent)
        command = 'export VIRTUAL_ENV="$1" PATH="${1}/bin:$PATH"; shift; exec "$@"'
        return ["sh", "-c", command, "uv-script", venv, interpreter, path]

    # ------------------------------------------------------------ files

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        client, sandbox_id = self._running()
        try:
            return await client.read_bytes(sandbox_id, path, max_bytes)
        except SandboxFileNotFoundError as e:
            raise FileNotFoundError(path) from e
        except APIError as e:
            raise SandboxError(f"read {path!r}: {e}") from e

    async def write(self, path: str, data: bytes) -> None:
        client, sandbox_id = self._running()
        try:
            await client.upload_bytes(sandbox_id, path, data, os.path.basename(path))
        except APIError as e:
            raise SandboxError(f"write {path!r}: {e}") from e


def _check_traversable(root: Path) -> None:
    """In the per-uid modes a sandbox sees the host's file system as its own uid: the
    cache must be reachable by any uid (no ``0700`` directory above it)."""
    for directory in (root, *root.parents):
        if not directory.stat().st_mode & 0o001:
            raise SandboxError(
                f"{root} (the harness cache or harness_python's installation) is not "
                f"reachable by the sandboxes' uids ({directory} is not traversable by "
                "others): set the runtime's harness_cache_root (or harness_python) to "
                "a directory they can traverse"
            )


def install() -> None:
    """Teach v1's runtime table the ``local_sandbox`` type (idempotent; every other type
    resolves as before). Called when a :class:`LocalSandboxRuntimeConfig` is made; call it
    yourself only to resolve the type from a config built without validation."""
    install_runtime_type(LocalSandboxRuntimeConfig, LocalSandboxRuntime)


__all__ = [
    "IsolationChoice",
    "LocalSandboxProcess",
    "LocalSandboxRuntime",
    "LocalSandboxRuntimeConfig",
    "LocalSandboxRuntimeInfo",
    "LocalSandboxStartError",
    "check_local_sandbox",
    "install",
]
