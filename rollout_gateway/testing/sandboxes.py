"""A fake of what ``CliAgentEnv`` calls on its sandbox client: :class:`FakeSandboxClient`.

An *agent* coroutine stands in for the sandboxed process; latencies and failures are
injected. prime-sandboxes (the extra that comes with either verifiers stack) is imported
only when its types are made: a core install imports this module, and uses the fake
without a job, command or status.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from rollout_gateway.launch import AGENT_PID_NAME

#: Text of the launch wrapper's start and exit reports that survives the shell quoting of
#: :func:`rollout_gateway.launch.agent_launch_command` (how the fake tells it was used).
_STARTED_MARK = '"started": true'
_EXIT_MARK = '\\"exit_code\\": $code'


@dataclass
class FakeSandbox:
    """A sandbox of :class:`FakeSandboxClient`."""

    id: str
    request: Any
    env_vars: dict[str, str]
    created_at: float
    deleted: bool = False
    agent_task: asyncio.Task[int] | None = None
    agent_exit_time: float | None = None
    job: Any = None
    #: The command the agent's job was started with.
    command: str = ""
    files: dict[str, str] = field(default_factory=dict)


AgentFn = Callable[[FakeSandbox], Awaitable[int]]
"""The stand-in for the agent process: gets the sandbox, returns the exit code."""


class FakeSandboxClient:
    """What ``CliAgentEnv``/``SandboxMixin`` call on ``sandbox_client``, in memory.

    Args:
        agent: coroutine run when the agent job starts; its return value is the exit
            code (an exception makes exit code 1 with the error on stderr).
        create_latency: seconds (or a callable giving them) that ``create`` takes.
        ready_latency: seconds (or a callable giving them) until a sandbox is ready.

    ``fail(method, *exceptions)`` queues exceptions for a method
    (``create``, ``wait_for_creation``, ``start_background_job``, ``get_background_job``,
    ``execute_command``, ``delete``).
    """

    def __init__(
        self,
        agent: AgentFn | None = None,
        *,
        create_latency: float | Callable[[], float] = 0.0,
        ready_latency: float | Callable[[], float] = 0.0,
    ) -> None:
        self.agent = agent or _exit_zero
        #: Called with the exit code when an agent started behind the reporting launch
        #: wrapper returns (the wrapper's exit report); a killed agent reports nothing.
        self.on_agent_exit: Callable[[FakeSandbox, int], None] | None = None
        #: Called when an agent starts behind the reporting launch wrapper (its start report).
        self.on_agent_start: Callable[[FakeSandbox], None] | None = None
        #: Whether the image has an HTTP client for the wrapper's reports (``False``: an
        #: image without curl, wget and python3: the wrapper reports nothing).
        self.http_client = True
        self.create_latency = create_latency
        self.ready_latency = ready_latency
        self.sandboxes: dict[str, FakeSandbox] = {}
        #: Answers ``execute_command`` before the default behaviour when it returns one.
        self.on_command: Callable[[FakeSandbox, str], Any] | None = None
        self.commands: list[str] = []
        self.calls: Counter[str] = Counter()
        self._failures: dict[str, list[BaseException]] = {}
        self._ids = itertools.count()
        self.torn_down = False

    def fail(self, method: str, *exceptions: BaseException) -> None:
        """Queue exceptions for the next calls of ``method``."""
        self._failures.setdefault(method, []).extend(exceptions)

    def _enter(self, method: str) -> None:
        self.calls[method] += 1
        queued = self._failures.get(method)
        if queued:
            raise queued.pop(0)

    @property
    def alive(self) -> list[str]:
        """Ids of sandboxes not deleted."""
        return [s.id for s in self.sandboxes.values() if not s.deleted]

    async def create(self, request: Any) -> SimpleNamespace:
        """Create a sandbox from a ``CreateSandboxRequest``."""
        self._enter("create")
        await _sleep(self.create_latency)
        sandbox_id = f"sbx-{next(self._ids)}"
        self.sandboxes[sandbox_id] = FakeSandbox(
            id=sandbox_id,
            request=request,
            env_vars=dict(request.environment_vars or {}),
            created_at=time.monotonic(),
        )
        return SimpleNamespace(id=sandbox_id, name=request.name)

    async def wait_for_creation(self, sandbox_id: str, **kwargs: Any) -> None:
        """Wait until the sandbox is ready."""
        self._enter("wait_for_creation")
        await _sleep(self.ready_latency)

    async def start_background_job(self, sandbox_id: str, command: str, **kwargs: Any) -> Any:
        """Start the agent coroutine as the sandbox's background job (a prime-sandboxes
        ``BackgroundJob``)."""
        from prime_sandboxes import BackgroundJob

        self._enter("start_background_job")
        sandbox = self._live(sandbox_id)
        sandbox.command = command
        if self._reports(command, _STARTED_MARK) and self.on_agent_start is not None:
            self.on_agent_start(sandbox)
        sandbox.agent_task = asyncio.ensure_future(self._run_agent(sandbox))
        sandbox.job = BackgroundJob(
            job_id=f"job-{sandbox_id}",
            sandbox_id=sandbox_id,
            stdout_log_file="/tmp/stdout",
            stderr_log_file="/tmp/stderr",
            exit_file="/tmp/exit",
        )
        return sandbox.job

    async def _run_agent(self, sandbox: FakeSandbox) -> int:
        code = 1
        try:
            code = await self.agent(sandbox)
            return code
        except asyncio.CancelledError:  # killed: its wrapper reports nothing
            sandbox.agent_exit_time = time.monotonic()
            raise
        finally:
            if sandbox.agent_exit_time is None:
                sandbox.agent_exit_time = time.monotonic()
                reports = self._reports(sandbox.command, _EXIT_MARK)
                if reports and self.on_agent_exit is not None:
                    self.on_agent_exit(sandbox, code)

    def _reports(self, command: str, mark: str) -> bool:
        """Whether a job started with ``command`` sends the wrapper's report marked ``mark``."""
        return self.http_client and mark in command

    async def get_background_job(
        self, sandbox_id: str, job: Any, timeout: int | None = None
    ) -> Any:
        """The job's status (a prime-sandboxes ``BackgroundJobStatus``): completed once the
        agent coroutine returned."""
        from prime_sandboxes import BackgroundJobStatus

        self._enter("get_background_job")
        sandbox = self._live(sandbox_id)
        task = sandbox.agent_task
        if task is None or not task.done():
            return BackgroundJobStatus(job_id=job.job_id, completed=False)
        if task.cancelled():
            return BackgroundJobStatus(job_id=job.job_id, completed=True, exit_code=137)
        error = task.exception()
        if error is not None:
            return BackgroundJobStatus(
                job_id=job.job_id, completed=True, exit_code=1, stdout="", stderr=str(error)
            )
        return BackgroundJobStatus(
            job_id=job.job_id, completed=True, exit_code=task.result(), stdout="ok", stderr=""
        )

    async def execute_command(self, sandbox_id: str, command: str, **kwargs: Any) -> Any:
        """Answer ``cat FILE`` from the sandbox's files, anything else with exit 0 (a
        prime-sandboxes ``CommandResponse``)."""
        from prime_sandboxes import CommandResponse

        self._enter("execute_command")
        sandbox = self._live(sandbox_id)
        self.commands.append(command)
        if self.on_command is not None:
            answer = self.on_command(sandbox, command)
            if answer is not None:
                return answer
        if AGENT_PID_NAME in command and "kill" in command:  # stop_agent_script
            if sandbox.agent_task is not None and not sandbox.agent_task.done():
                sandbox.agent_task.cancel()
            return CommandResponse(stdout="", stderr="", exit_code=0)
        if command.startswith("cat "):
            path = command[4:].strip()
            if path in sandbox.files:
                return CommandResponse(stdout=sandbox.files[path], stderr="", exit_code=0)
            return CommandResponse(stdout="", stderr="no such file", exit_code=1)
        return CommandResponse(stdout="", stderr="", exit_code=0)

    async def delete(self, sandbox_id: str) -> dict[str, Any]:
        """Delete a sandbox (and stop its agent)."""
        self._enter("delete")
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None and not sandbox.deleted:
            sandbox.deleted = True
            if sandbox.agent_task is not None and not sandbox.agent_task.done():
                sandbox.agent_task.cancel()
        return {"success": True}

    async def bulk_delete(self, sandbox_ids: list[str] | None = None, **kwargs: Any) -> None:
        """Delete several sandboxes."""
        for sandbox_id in sandbox_ids or []:
            await self.delete(sandbox_id)

    def delete_all(self) -> None:
        """Synchronous delete of everything (teardown)."""
        for sandbox in self.sandboxes.values():
            sandbox.deleted = True
            if sandbox.agent_task is not None and not sandbox.agent_task.done():
                sandbox.agent_task.cancel()

    def teardown(self, wait: bool = True) -> None:
        """Like ``ThreadedAsyncSandboxClient.teardown``."""
        self.torn_down = True

    def _live(self, sandbox_id: str) -> FakeSandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.deleted:
            raise RuntimeError(f"sandbox {sandbox_id} is not running")
        return sandbox


async def _exit_zero(sandbox: FakeSandbox) -> int:
    return 0


async def _sleep(latency: float | Callable[[], float]) -> None:
    seconds = latency() if callable(latency) else latency
    if seconds:
        await asyncio.sleep(seconds)


def rollout_id_of(sandbox: FakeSandbox) -> str:
    """The rollout id in a sandbox's ``OPENAI_BASE_URL`` (``.../v1/rollouts/{id}``)."""
    return sandbox.env_vars["OPENAI_BASE_URL"].rstrip("/").rsplit("/", 1)[-1]


__all__ = ["AgentFn", "FakeSandbox", "FakeSandboxClient", "rollout_id_of"]
