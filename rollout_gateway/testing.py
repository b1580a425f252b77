"""In-memory fakes for the mixin's seams, for tests and benchmarks of env code.

- :class:`FakeGateway`: the gateway protocol's control plane as an httpx transport
  (pass ``gateway.transport()`` as ``gateway_transport``), with failure injection.
- :class:`FakeSandboxClient`: what ``CliAgentEnv`` calls on its sandbox client, with an
  *agent* coroutine standing in for the sandboxed process, latencies and failure
  injection.
- :class:`FakeTunnelProvider`: counts tunnel starts, can be slow, fail or die.

They hold no network resource; nothing here is used by the package at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import httpx
import orjson
from prime_sandboxes import BackgroundJob, BackgroundJobStatus, CommandResponse

from rollout_gateway import protocol
from rollout_gateway.exits import ExitBoard
from rollout_gateway.launch import AGENT_PID_NAME

#: Text of the launch wrapper's start and exit reports that survives the shell quoting of
#: :func:`rollout_gateway.launch.agent_launch_command` (how the fake tells it was used).
_STARTED_MARK = '"started": true'
_EXIT_MARK = '\\"exit_code\\": $code'

Failure = int | BaseException
"""An injected failure: an HTTP status to answer, or an exception to raise."""


@dataclass
class FakeRollout:
    """A rollout as the fake gateway holds it."""

    rollout_id: str
    register_body: dict[str, Any]
    status: str = "active"
    api_key: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    trajectory_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class FakeGateway:
    """The control plane of the gateway protocol, in memory.

    ``fail(op, *failures)`` queues failures for an operation (``register``,
    ``trajectory``, ``cancel``, ``unregister``): each request of that op consumes one.
    ``latency`` (seconds, or a callable returning seconds) delays every answer.
    Agents add turns with :meth:`add_turn`.
    """

    def __init__(
        self,
        *,
        issue_api_keys: bool = False,
        latency: float | Callable[[], float] = 0.0,
        exit_reports: bool = True,
        exit_stream: bool = True,
        delta_trajectories: bool = True,
    ) -> None:
        self.rollouts: dict[str, FakeRollout] = {}
        #: Whether the exit-report extension is served (else its routes answer 404).
        self.exit_reports = exit_reports
        #: Whether ``stream=1`` is honoured (else the long-poll answers, as an older
        #: gateway that does not know the parameter would).
        self.exit_stream = exit_stream
        #: The exit streams open now, and the cursor each was opened with (in order).
        self.exit_streams: list[FakeExitStream] = []
        self.exit_stream_cursors: list[int] = []
        #: Whether ``?format=delta`` is honoured (else the full form is always sent).
        self.delta_trajectories = delta_trajectories
        self.exit_board = ExitBoard()
        self.issue_api_keys = issue_api_keys
        self.latency = latency
        self.calls: list[tuple[str, str]] = []
        self.op_counts: Counter[str] = Counter()
        self._failures: dict[str, list[Failure]] = {}
        self.unregistered: list[str] = []
        self.cancelled: list[str] = []

    def transport(self) -> httpx.AsyncBaseTransport:
        """An httpx transport answering with this gateway."""
        return httpx.MockTransport(self.handle)

    def fail(self, op: str, *failures: Failure) -> None:
        """Queue failures for the next requests of ``op``."""
        self._failures.setdefault(op, []).extend(failures)

    @property
    def active(self) -> list[str]:
        """Ids of rollouts still registered."""
        return list(self.rollouts)

    def add_turn(
        self,
        rollout_id: str,
        prompt: list[dict[str, Any]],
        completion: list[dict[str, Any]],
        *,
        tokens: dict[str, Any] | None = None,
        is_truncated: bool = False,
    ) -> None:
        """Record one turn, as the data plane would after a chat completion."""
        rollout = self.rollouts[rollout_id]
        if rollout.status != "active":
            raise RuntimeError(f"rollout {rollout_id} is {rollout.status}")
        rollout.steps.append(
            {
                "prompt": prompt,
                "completion": completion,
                "tokens": tokens,
                "reward": None,
                "advantage": None,
                "is_truncated": is_truncated,
                "trajectory_id": rollout.trajectory_id,
                "extras": {},
            }
        )

    def report_exit(self, rollout_id: str, exit_code: int | None) -> None:
        """Record an agent's exit report, as its launch wrapper would send it."""
        if self.exit_reports and rollout_id in self.rollouts:
            self.exit_board.report(rollout_id, exit_code)

    def drop_exit_streams(self) -> None:
        """Break every open exit stream, as a reset connection would."""
        for stream in self.exit_streams:
            stream.dropped = True
        self.exit_board.wake()

    def agent_exited(self, sandbox: FakeSandbox, exit_code: int) -> None:
        """A :class:`FakeSandboxClient` ``on_agent_exit`` hook: the wrapper's report."""
        self.report_exit(rollout_id_of(sandbox), exit_code)

    def agent_started(self, sandbox: FakeSandbox) -> None:
        """A :class:`FakeSandboxClient` ``on_agent_start`` hook: the wrapper's start report."""
        rollout_id = rollout_id_of(sandbox)
        if self.exit_reports and rollout_id in self.rollouts:
            self.exit_board.report(rollout_id, None, started=True)

    def refuse(self, rollout_id: str, code: str = "max_turns_reached") -> None:
        """Refuse the rollout's turns from now on (as at a limit) and report the refusal
        on the exit channel, as the reference gateway does."""
        rollout = self.rollouts[rollout_id]
        rollout.status = "completed"
        if self.exit_reports:
            self.exit_board.refused(rollout_id, code)

    def watch(self, sandboxes: FakeSandboxClient) -> None:
        """Hear the launch wrapper's reports of ``sandboxes``' agents (start and exit)."""
        sandboxes.on_agent_start = self.agent_started
        sandboxes.on_agent_exit = self.agent_exited

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """The transport's handler."""
        latency = self.latency() if callable(self.latency) else self.latency
        if latency:
            await asyncio.sleep(latency)
        self.calls.append((request.method, request.url.path))
        if request.url.path == protocol.EXITS_PATH and request.method == "GET":
            return await self._exits(request)
        parsed = protocol.parse_rollout_path(request.url.path)
        if parsed is None:
            return _error(404, "no such route")
        rollout_id, op = parsed
        self.op_counts[op] += 1
        queued = self._failures.get(op)
        if queued:
            failure = queued.pop(0)
            if isinstance(failure, BaseException):
                raise failure
            return _error(failure, f"injected {failure}")
        rollout = self.rollouts.get(rollout_id)
        if op == "register" and request.method == "POST":
            if rollout is not None:
                return _error(409, "already registered")
            return self._register(rollout_id, request)
        if rollout is None:
            return _error(404, f"unknown rollout {rollout_id}")
        if op == "exit" and request.method == "POST" and self.exit_reports:
            body = json.loads(request.content or b"{}")
            started = body.get("started") is True
            self.exit_board.report(rollout_id, body.get("exit_code"), started=started)
            return _answer(200, {"rollout_id": rollout_id, "status": "exit_reported"})
        if op == "trajectory" and request.method == "GET":
            return _answer(200, self._trajectory(rollout, request.url.params.get("format")))
        if op == "cancel" and request.method == "POST":
            rollout.status = "cancelled"
            self.cancelled.append(rollout_id)
            return _answer(200, {"rollout_id": rollout_id, "status": "cancelled"})
        if op == "unregister" and request.method == "POST":
            del self.rollouts[rollout_id]
            self.exit_board.forget(rollout_id)
            self.unregistered.append(rollout_id)
            return _answer(200, {"rollout_id": rollout_id, "status": rollout.status})
        return _error(404, "no such route")

    async def _exits(self, request: httpx.Request) -> httpx.Response:
        """The exit reports: the stream (``stream=1``) or the long-poll."""
        self.op_counts["exits"] += 1
        if not self.exit_reports:
            return _error(404, "no such route")
        params = request.url.params
        after = int(params.get("after", "0"))
        if params.get("stream") == "1" and self.exit_stream:
            self.exit_stream_cursors.append(after)
            return httpx.Response(
                200,
                headers={"Content-Type": protocol.EXIT_STREAM_MEDIA_TYPE},
                stream=FakeExitStream(self, after),
            )
        answer = await self.exit_board.wait(after, float(params.get("timeout", "0")))
        return _answer(200, answer)

    def _register(self, rollout_id: str, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        rollout = FakeRollout(rollout_id, body)
        if self.issue_api_keys:  # like the reference server: a proposed key is honoured
            rollout.api_key = body.get("api_key") or f"key-{uuid.uuid4().hex}"
        self.rollouts[rollout_id] = rollout
        registered = protocol.register_response(rollout_id, body, api_key=rollout.api_key)
        if rollout.api_key is None:
            registered.pop("api_key", None)
        return _answer(200, registered)

    def _trajectory(self, rollout: FakeRollout, answer_format: str | None) -> dict[str, Any]:
        """The trajectory answer of ``rollout`` (the delta form when asked and enabled)."""
        steps = rollout.steps
        prompt = steps[0]["prompt"] if steps else []
        completion: list[dict[str, Any]] = []
        if steps:
            last = steps[-1]
            completion = (last["prompt"] + last["completion"])[len(prompt) :]
        trajectory: dict[str, Any] = {
            "rollout_id": rollout.rollout_id,
            "status": rollout.status,
            "num_turns": len(steps),
            "model": rollout.register_body.get("model"),
            "prompt": prompt,
            "completion": completion,
            "is_truncated": any(s["is_truncated"] for s in steps),
            "trajectory": steps,
        }
        if answer_format == "delta" and self.delta_trajectories:
            trajectory["trajectory"] = protocol.delta_steps(
                cast(list[protocol.TrajectoryStepBody], steps)
            )
            trajectory["format"] = "delta"
        return trajectory


class FakeExitStream(httpx.AsyncByteStream):
    """The body of one exit stream of a :class:`FakeGateway` (its board's lines)."""

    def __init__(self, gateway: FakeGateway, after: int) -> None:
        self.gateway = gateway
        self.after = after
        #: Set by :meth:`FakeGateway.drop_exit_streams`: the next read fails.
        self.dropped = False
        self._chunks: AsyncGenerator[bytes, None] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._chunks is None:
            self._chunks = self._follow()
        return self._chunks

    async def aclose(self) -> None:
        """End the stream (the client closed the response)."""
        # A reader torn down mid-read (its loop gone) unwinds the generator itself.
        if self._chunks is not None and not getattr(self._chunks, "ag_running", False):
            await self._chunks.aclose()

    async def _follow(self) -> AsyncGenerator[bytes, None]:
        self.gateway.exit_streams.append(self)
        lines = self.gateway.exit_board.follow(self.after, closed=lambda: self.dropped)
        try:
            async with contextlib.aclosing(lines):
                async for chunk in lines:
                    yield chunk
            raise httpx.ReadError("connection reset (FakeGateway.drop_exit_streams)")
        finally:
            self.gateway.exit_streams.remove(self)


def _answer(status: int, body: Any) -> httpx.Response:
    # orjson, like the reference gateway: a fake that spends more on JSON than the real
    # one would load the process it shares with the env under test.
    return httpx.Response(
        status, content=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )


def _error(status: int, message: str) -> httpx.Response:
    return _answer(status, {"error": {"message": message, "type": "fake"}})


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
    job: BackgroundJob | None = None
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
        self.on_command: Callable[[FakeSandbox, str], CommandResponse | None] | None = None
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

    async def start_background_job(
        self, sandbox_id: str, command: str, **kwargs: Any
    ) -> BackgroundJob:
        """Start the agent coroutine as the sandbox's background job."""
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
        self, sandbox_id: str, job: BackgroundJob, timeout: int | None = None
    ) -> BackgroundJobStatus:
        """The job's status: completed once the agent coroutine returned."""
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

    async def execute_command(
        self, sandbox_id: str, command: str, **kwargs: Any
    ) -> CommandResponse:
        """Answer ``cat FILE`` from the sandbox's files, anything else with exit 0."""
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


class FakeTunnelHandle:
    """A fake tunnel; ``alive = False`` simulates a dead frpc process."""

    def __init__(self, url: str, tunnel_id: str | None = None) -> None:
        self._url = url
        #: The provider's id of the tunnel (as ``prime_tunnel.Tunnel.tunnel_id``).
        self.tunnel_id = tunnel_id
        self.alive = True
        self.registered = True
        self.stops = 0

    @property
    def url(self) -> str:
        """The public URL."""
        return self._url

    def is_running(self) -> bool:
        """Whether the fake process lives."""
        return self.alive

    async def check_healthy(self) -> bool:
        """Whether the fake tunnel is still registered."""
        return self.registered

    async def stop(self) -> None:
        """Stop (counted)."""
        self.stops += 1
        self.alive = False


class FakeTunnelProvider:
    """Opens :class:`FakeTunnelHandle` s; ``start_latency`` seconds each; counts opens.

    The public URL is ``https://tunnel-{n}.example`` so tests can tell tunnels apart.
    ``fail_next`` makes the next opens raise it.
    """

    def __init__(self, start_latency: float = 0.0) -> None:
        self.start_latency = start_latency
        self.opened: list[tuple[str, int]] = []
        self.handles: list[FakeTunnelHandle] = []
        self.fail_next: list[BaseException] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def open(self, gateway_url: str, host: str, port: int) -> FakeTunnelHandle:
        """Open a fake tunnel to ``host:port``."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await _sleep(self.start_latency)
            if self.fail_next:
                raise self.fail_next.pop(0)
            self.opened.append((host, port))
            n = len(self.opened)
            handle = FakeTunnelHandle(f"https://tunnel-{n}.example", tunnel_id=f"tunnel-{n}")
            self.handles.append(handle)
            return handle
        finally:
            self.in_flight -= 1


def task_row(example_id: int) -> dict[str, Any]:
    """One rollout input row in verifiers' format (for datasets and ``env.rollout``).

    ``info`` carries ``task_id``, not ``task``: verifiers reserves ``info["task"]``.
    """
    return {
        "prompt": [{"role": "user", "content": f"Fix bug #{example_id}"}],
        "answer": "fixed",
        "info": {"task_id": example_id},
        "example_id": example_id,
    }


#: The example agent's one tool, ``run_shell(command)``, as an OpenAI tool definition (for
#: conversations sent to real engines by tests and benchmarks).
RUN_SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def run_shell_call(call_id: str, command: str) -> dict[str, Any]:
    """An assistant message calling :data:`RUN_SHELL_TOOL` with ``command``."""
    function = {"name": "run_shell", "arguments": json.dumps({"command": command})}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def uniform(low: float, high: float, rng: random.Random | None = None) -> Callable[[], float]:
    """A latency callable drawing uniformly from ``[low, high]`` seconds."""
    source = rng or random.Random()
    return lambda: source.uniform(low, high)


async def _sleep(latency: float | Callable[[], float]) -> None:
    seconds = latency() if callable(latency) else latency
    if seconds:
        await asyncio.sleep(seconds)


def rollout_id_of(sandbox: FakeSandbox) -> str:
    """The rollout id in a sandbox's ``OPENAI_BASE_URL`` (``.../v1/rollouts/{id}``)."""
    return sandbox.env_vars["OPENAI_BASE_URL"].rstrip("/").rsplit("/", 1)[-1]


__all__ = [
    "RUN_SHELL_TOOL",
    "AgentFn",
    "FakeExitStream",
    "FakeGateway",
    "FakeRollout",
    "FakeSandbox",
    "FakeSandboxClient",
    "FakeTunnelHandle",
    "FakeTunnelProvider",
    "rollout_id_of",
    "run_shell_call",
    "task_row",
    "uniform",
]
