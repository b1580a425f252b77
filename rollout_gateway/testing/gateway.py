"""The reference gateway in this process, as an httpx transport, with faults injected.

:class:`FakeGateway` is the real gateway app (:func:`~rollout_gateway.server.create_app`
on the memory store, the scripted model behind it) reached through
:class:`~.asgi.StreamingASGITransport`, so an env under test meets the gateway's own
control plane, trajectories and exit channel. Only the transport in front of it is the
fake's: it counts calls, adds latency, answers queued failures (:meth:`FakeGateway.fail`)
and can play a gateway without the protocol's extensions (exit reports, the exit stream,
the delta form). Agents record turns with :meth:`FakeGateway.add_turn` (the gateway's own
recorder and ledger, without an engine call) or through the data plane itself.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from rollout_gateway import protocol
from rollout_gateway.exits import ExitBoard
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server.app import Gateway, create_app
from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.lifespan import open_state
from rollout_gateway.server.state.ledger import TurnUse
from rollout_gateway.testing.asgi import StreamingASGITransport

if TYPE_CHECKING:
    from rollout_gateway.testing.sandboxes import FakeSandbox, FakeSandboxClient

Failure = int | BaseException
"""An injected failure: an HTTP status to answer, or an exception to raise."""

#: The scripted model behind the fake gateway (reached in process: no network).
ENGINE_URL = "http://scripted-model.fake/v1"


@dataclass
class FakeRollout:
    """A rollout registered through the fake gateway's transport."""

    rollout_id: str
    register_body: dict[str, Any]
    #: The key the gateway issued (``None``: keys off, ``issue_api_keys=False``).
    api_key: str | None = None


class FakeGateway:
    """The reference gateway, in memory, as an httpx transport (``transport()``).

    Args:
        issue_api_keys: register hands out per-rollout keys (the data plane checks them).
        latency: seconds (or a callable giving them) every answer takes.
        exit_reports: the exit-report extension is served (else its routes answer 404).
        exit_stream: ``stream=1`` is honoured (else the long-poll answers, as a gateway
            that does not know the parameter would).
        delta_trajectories: ``?format=delta`` is honoured (else the full form is sent).

    ``fail(op, *failures)`` queues failures for an operation (``register``,
    ``trajectory``, ``cancel``, ``unregister``...): each request of that op consumes one.
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
        config = GatewayConfig(
            upstreams=[ENGINE_URL], open_control_plane=True, require_rollout_keys=issue_api_keys
        )
        engine = httpx.ASGITransport(create_scripted_model_app())
        #: The gateway's app, and the gateway (its registry, ledger, exit board...).
        self.app = create_app(config, upstream_transport=engine)
        self.gateway: Gateway = self.app.state.gateway
        self._app = StreamingASGITransport(self.app)
        self.latency = latency
        self.exit_reports = exit_reports
        self.exit_stream = exit_stream
        self.delta_trajectories = delta_trajectories
        #: Every request, in order, and how many of each operation.
        self.calls: list[tuple[str, str]] = []
        self.op_counts: Counter[str] = Counter()
        #: Rollouts registered through the transport and not unregistered.
        self.rollouts: dict[str, FakeRollout] = {}
        self.unregistered: list[str] = []
        self.cancelled: list[str] = []
        #: The exit streams open now, and the cursor each was opened with (in order).
        self.exit_streams: list[FakeExitStream] = []
        self.exit_stream_cursors: list[int] = []
        self._failures: dict[str, list[Failure]] = {}
        self._refused: set[str] = set()
        self._writes: set[asyncio.Task[None]] = set()

    @property
    def exit_board(self) -> ExitBoard:
        """The gateway's exit reports."""
        return self.gateway.exit_board

    @property
    def active(self) -> list[str]:
        """Ids of rollouts still registered."""
        return list(self.rollouts)

    def transport(self) -> httpx.AsyncBaseTransport:
        """An httpx transport answering with this gateway."""
        return httpx.MockTransport(self.handle)

    def fail(self, op: str, *failures: Failure) -> None:
        """Queue failures for the next requests of ``op``."""
        self._failures.setdefault(op, []).extend(failures)

    # -- what agents and the launch wrapper do ----------------------------------------------

    def add_turn(
        self,
        rollout_id: str,
        prompt: list[dict[str, Any]],
        completion: list[dict[str, Any]],
        *,
        tokens: dict[str, Any] | None = None,
        is_truncated: bool = False,
    ) -> None:
        """Record one turn, as the data plane does after a chat completion: the gateway's
        recorder takes the step (``tokens``: its ``prompt_ids``, ``completion_ids`` and
        ``completion_logprobs``), its ledger counts and stores it."""
        record = self.gateway.registry.get(rollout_id)
        if record is None:
            raise KeyError(rollout_id)
        if record.status != "active" or rollout_id in self._refused:
            raise RuntimeError(f"rollout {rollout_id} takes no more turns ({record.status})")
        ids = tokens or {}

        async def turn() -> None:
            record.recorder.record(
                prompt, completion, prompt_ids=ids.get("prompt_ids"),
                completion_ids=ids.get("completion_ids"),
                completion_logprobs=ids.get("completion_logprobs"), truncated=is_truncated,
            )  # fmt: skip
            use = TurnUse(0, len(ids.get("completion_ids") or ()))
            await self.gateway.ledger.count_turn(record, use, None)

        self._write(turn)

    def report_exit(self, rollout_id: str, exit_code: int | None) -> None:
        """Record an agent's exit report, as its launch wrapper would send it."""
        if self.exit_reports and rollout_id in self.rollouts:
            self.exit_board.report(rollout_id, exit_code)

    def agent_exited(self, sandbox: FakeSandbox, exit_code: int) -> None:
        """A :class:`~.sandboxes.FakeSandboxClient` ``on_agent_exit`` hook: the wrapper's
        report."""
        from rollout_gateway.testing.sandboxes import rollout_id_of

        self.report_exit(rollout_id_of(sandbox), exit_code)

    def agent_started(self, sandbox: FakeSandbox) -> None:
        """A :class:`~.sandboxes.FakeSandboxClient` ``on_agent_start`` hook: the wrapper's
        start report."""
        from rollout_gateway.testing.sandboxes import rollout_id_of

        rollout_id = rollout_id_of(sandbox)
        if self.exit_reports and rollout_id in self.rollouts:
            self.exit_board.report(rollout_id, None, started=True)

    def watch(self, sandboxes: FakeSandboxClient) -> None:
        """Hear the launch wrapper's reports of ``sandboxes``' agents (start and exit)."""
        sandboxes.on_agent_start = self.agent_started
        sandboxes.on_agent_exit = self.agent_exited

    def refuse(self, rollout_id: str, code: str = "max_turns_reached") -> None:
        """Refuse the rollout's turns from now on (as at a limit) and report the refusal
        on the exit channel, as the gateway does."""
        self._refused.add(rollout_id)
        if self.exit_reports:
            self.exit_board.refused(rollout_id, code)

    def drop_exit_streams(self) -> None:
        """Break every open exit stream, as a reset connection would."""
        for stream in list(self.exit_streams):
            stream.drop()

    # -- the transport -----------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """The transport's handler: faults first, then the gateway's own answer."""
        latency = self.latency() if callable(self.latency) else self.latency
        if latency:
            await asyncio.sleep(latency)
        self.calls.append((request.method, request.url.path))
        while self._writes:  # the turns agents recorded are stored before anything is read
            await asyncio.gather(*self._writes, return_exceptions=True)
        await open_state(self.gateway)
        path = request.url.path
        if path == protocol.EXITS_PATH:
            return await self._exits(request)
        parsed = protocol.parse_rollout_path(path)
        op = parsed[1] if parsed is not None else path
        self.op_counts[op] += 1
        queued = self._failures.get(op)
        if queued:
            failure = queued.pop(0)
            if isinstance(failure, BaseException):
                raise failure
            return _error(failure, f"injected {failure}")
        if op == "exit" and not self.exit_reports:
            return _error(404, "no such route")
        if op == "trajectory" and not self.delta_trajectories:
            request = _without_param(request, "format")
        response = await self._answer(request)
        if parsed is not None and response.status_code == 200:
            self._note(parsed[0], op, request, response)
        return response

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        """The gateway's whole answer to ``request``."""
        response = await self._app.handle_async_request(request)
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return httpx.Response(response.status_code, headers=response.headers, content=content)

    async def _exits(self, request: httpx.Request) -> httpx.Response:
        """The exit reports: the stream (``stream=1``) or the long-poll."""
        self.op_counts["exits"] += 1
        if not self.exit_reports:
            return _error(404, "no such route")
        params = request.url.params
        if params.get("stream") == "1" and not self.exit_stream:
            request = _without_param(request, "stream")
        elif params.get("stream") == "1":
            self.exit_stream_cursors.append(int(params.get("after", "0")))
            response = await self._app.handle_async_request(request)
            if response.status_code == 200:
                response.stream = FakeExitStream(self, response.stream)
            return response
        return await self._answer(request)

    def _note(
        self, rollout_id: str, op: str, request: httpx.Request, response: httpx.Response
    ) -> None:
        """Keep what an answered register, cancel or unregister changed."""
        if op == "register":
            answer = response.json()
            body = json.loads(request.content or b"{}")
            self.rollouts[rollout_id] = FakeRollout(rollout_id, body, answer.get("api_key"))
        elif op == "unregister":
            self.rollouts.pop(rollout_id, None)
            self.unregistered.append(rollout_id)
        elif op == "cancel":
            self.cancelled.append(rollout_id)

    def _write(self, write: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``write`` after the writes before it (turns are recorded in order), before
        the next request is answered."""
        before = list(self._writes)

        async def after() -> None:
            await asyncio.gather(*before, return_exceptions=True)
            await write()

        task = asyncio.get_running_loop().create_task(after())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)


class FakeExitStream(httpx.AsyncByteStream):
    """The body of one exit stream of a :class:`FakeGateway` (the gateway's own lines),
    which :meth:`FakeGateway.drop_exit_streams` can break."""

    def __init__(self, gateway: FakeGateway, body: Any) -> None:
        self.gateway = gateway
        self._body = body
        #: Set by :meth:`drop`: the next read fails, as a reset connection's would.
        self.dropped = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.gateway.exit_streams.append(self)
        try:
            async for chunk in self._body:
                if self.dropped:
                    break
                yield chunk
            if self.dropped:
                raise httpx.ReadError("connection reset (FakeGateway.drop_exit_streams)")
        finally:
            if self in self.gateway.exit_streams:
                self.gateway.exit_streams.remove(self)

    def drop(self) -> None:
        """Break the stream."""
        self.dropped = True
        self._body.fail(httpx.ReadError("connection reset (FakeGateway.drop_exit_streams)"))

    async def aclose(self) -> None:
        """End the stream (the client closed the response)."""
        await self._body.aclose()


def _without_param(request: httpx.Request, name: str) -> httpx.Request:
    """``request`` without query parameter ``name`` (a gateway that does not know it)."""
    url = request.url.copy_remove_param(name)
    return httpx.Request(request.method, url, headers=request.headers, content=request.content)


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "fake"}})


__all__ = ["ENGINE_URL", "Failure", "FakeExitStream", "FakeGateway", "FakeRollout"]
