"""The data plane: one chat turn of a rollout, from the agent's request to its answer.

A request is matched against the rollout's turns first
(:mod:`~rollout_gateway.server.state.dedupe`): a retry waits for the turn it repeats. A
new request becomes a turn task; turns of one rollout run one at a time, in order, under
the rollout's lock, and each checks the rollout's budgets (:mod:`.limits`) before it calls
the upstream. The turn task is not the request's: when
the agent disconnects the turn still finishes and is recorded, and a retry gets its
answer; if nobody ever gets it, it is recorded as abandoned when the agent moves on.

A streaming agent is answered from the turn's
:class:`~rollout_gateway.server.engines.streaming.EventLog`: chunks as the engine sends
them (vLLM is streamed from, :mod:`~rollout_gateway.server.engines.turn`), SSE keepalive
comments while it is silent, then ``[DONE]``. The response starts at the first chunk, or
after one keepalive interval: an error before that keeps its HTTP status; after it, it
arrives as an SSE error event. The engine call and the step's facts are
:mod:`~rollout_gateway.server.engines.turn`'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from rollout_gateway.interrupt import Interrupt
from rollout_gateway.server.agents.dialect_turns import (
    CHAT,
    DialectTurn,
    as_gateway_error,
    dialect_answer,
    dialect_fingerprint,
)
from rollout_gateway.server.agents.limits import (
    NO_RETRY_HEADERS,
    TurnRefused,
    check_takes_turn,
)
from rollout_gateway.server.agents.request import AgentRequest
from rollout_gateway.server.agents.sse import (
    DONE_EVENT,
    error_event,
    guard_sse,
    iter_completion_sse,
)
from rollout_gateway.server.agents.turn_runner import TurnRequest, TurnRunner
from rollout_gateway.server.dialects.base import Dialect, ParsedRequest
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.dialects.routes import dialect_named
from rollout_gateway.server.engines.streaming import EventLog
from rollout_gateway.server.engines.turn import (
    wants_usage,
)
from rollout_gateway.server.engines.upstream_request import (
    drop_unread_values,
    validate_max_tokens,
)
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.body_prefix import loads_extending
from rollout_gateway.server.http.jsonio import JSONBytesResponse
from rollout_gateway.server.http.responses import (
    ApiError,
    ClientGone,
    parse_json_object,
    validate_answer_flags,
    validate_messages,
)
from rollout_gateway.server.state.dedupe import Turn
from rollout_gateway.server.state.registry import RolloutRecord

if TYPE_CHECKING:
    from rollout_gateway.server.context import GatewayContext

logger = logging.getLogger("rollout_gateway.server")

#: Requests that may wait for one turn at once: the original and its retries (an SDK
#: retries two or three times). Each holds a connection until the turn ends, so without
#: a bound one agent repeating a slow turn could hold every connection of the gateway.
MAX_TURN_WAITERS = 8


def _retrieve(task: asyncio.Task[Any]) -> None:
    # Nobody may await a turn whose agent left: fetch its exception so asyncio does not
    # log "Task exception was never retrieved".
    if not task.cancelled():
        task.exception()


class ChatTurns:
    """Chat turns of every rollout of one gateway."""

    def __init__(self, gateway: GatewayContext) -> None:
        self.gateway = gateway
        #: The turns themselves, from admission to the recorded answer.
        self.runner = TurnRunner(gateway)

    async def handle(
        self, request: AgentRequest, record: RolloutRecord, dialect: Dialect = CHAT
    ) -> Response:
        """Answer one request of ``record`` (authenticated already) sent in ``dialect``."""
        intake = self.gateway.intake
        lease = request.lease = intake.lease(record.rollout_id)  # the endpoint releases it
        try:
            raw = await intake.read(
                lease, request.receive, request.content_length, request.read_timer
            )
        except ClientGone:
            logger.info("rollout=%s agent disconnected while sending", record.rollout_id)
            return Response(status_code=499)
        # A big body's work runs off the loop, on its rollout's share of time.
        fingerprint_of = self.gateway.rollouts.fingerprint  # keyed with the store's secret
        fingerprint = (
            await intake.offload(lease, fingerprint_of, raw) if lease.big else fingerprint_of(raw)
        )
        if dialect is not CHAT:
            fingerprint = dialect_fingerprint(dialect, fingerprint)
        if record.status != "active":  # may be refused before its body is parsed
            await self._refuse_early(record, fingerprint, request)
        if dialect is CHAT:
            body = await parse_json_object(raw, lambda raw: intake.parse(lease, raw))
        else:  # the history its previous body repeated is not parsed again
            loads = functools.partial(loads_extending, previous=record.body_prefix)
            body = await parse_json_object(raw, lambda raw: intake.parse(lease, raw, loads))
            record.body_prefix = lease.prefix
        del raw  # only the parsed body lives on (and a dialect body's prefix)
        lease.drop_raw()
        body, messages, parsed = await self._checked(body, record, dialect, lease)
        turn = self._joined(record, fingerprint, request)
        if turn is None:
            turn = await self._started(record, fingerprint, request, body, messages, parsed)
        turn.waiters += 1
        if body.get("stream") and turn.events is not None and not turn.task.done():
            return await self._stream(turn, body, parsed)
        try:
            completion = await self._await(turn, request)
        except ClientGone:
            turn.waiters -= 1
            logger.info("rollout=%s agent disconnected before its answer", record.rollout_id)
            return Response(status_code=499)
        turn.delivered = True
        if parsed is not None:
            return dialect_answer(dialect, parsed, completion)
        return _chat_answer(completion, body)

    async def _refuse_early(
        self, record: RolloutRecord, fingerprint: bytes, request: AgentRequest
    ) -> None:
        """Refuse a request of a rollout that takes no more turns before its body is
        parsed (a retry of an answered turn still gets its answer: see
        :func:`~.limits.check_takes_turn`)."""
        try:
            check_takes_turn(
                record, self.gateway.rollouts, fingerprint, request.idempotency_key,
                is_retry=request.is_retry,
            )  # fmt: skip
        except TurnRefused as exc:
            await self.gateway.ledger.refuse(record, exc.reason)
            self.runner.tell_refusal(record, exc)
            raise

    async def _checked(
        self, body: dict[str, Any], record: RolloutRecord, dialect: Dialect, lease: Any
    ) -> tuple[dict[str, Any], list[Any], ParsedRequest | None]:
        """The request in chat form, checked: its body, its messages, and the dialect's
        parse (``None`` for a chat request, checked as it always was)."""
        parsed: ParsedRequest | None = None
        if dialect is CHAT:
            drop_unread_values(body)
            messages = validate_messages(body, self.gateway.config.limits.max_messages)
            validate_answer_flags(body)
        else:
            parsed = await self._parse(dialect, body, record, lease)
            body, messages = parsed.body, parsed.messages
        validate_max_tokens(body)
        return body, messages, parsed

    def _joined(
        self, record: RolloutRecord, fingerprint: bytes, request: AgentRequest
    ) -> Turn | None:
        """The earlier turn this request repeats (a retry joins it), if any."""
        if record.status == "cancelled":  # a cancelled rollout answers nothing more
            return None
        turn = record.turns.match(fingerprint, request.idempotency_key, is_retry=request.is_retry)
        if turn is None:
            return None
        if turn.waiters >= MAX_TURN_WAITERS:
            raise ApiError(
                429,
                f"this request repeats a turn {turn.waiters} requests already wait for",
                "rate_limit_error",
                code="too_many_waiters",
                headers=NO_RETRY_HEADERS,
            )
        self.gateway.metrics.deduplicated_requests.inc()
        logger.info("rollout=%s retried request joins its earlier turn", record.rollout_id)
        return turn

    async def _started(
        self,
        record: RolloutRecord,
        fingerprint: bytes,
        request: AgentRequest,
        body: dict[str, Any],
        messages: list[Any],
        parsed: ParsedRequest | None,
    ) -> Turn:
        """A new turn of ``record``, its task started (:meth:`.TurnRunner.run`)."""
        if len(record.turns.pending) >= self.gateway.config.limits.max_pending_turns:
            raise ApiError(
                429,
                "too many concurrent requests for this rollout",
                "rate_limit_error",
                code="too_many_pending_turns",
            )
        key, is_retry, stream = request.idempotency_key, request.is_retry, bool(body.get("stream"))
        if parsed is None:
            turn = Turn(fingerprint, key, is_retry)
        else:
            renderer = dialect_named(parsed.dialect).stream(parsed) if stream else None
            turn = DialectTurn(fingerprint, key, is_retry, renderer=renderer)
        if stream:
            turn.events = EventLog()
        # Written now, while the parsed body is in the CPU's caches: the history check
        # and the upstream request both use this text (see recording/history.py).
        # A chat body's parse wrote it already, checking the body's depth
        # (jsonio.ParsedBody); a dialect's parse wrote its translation's.
        lease = request.lease
        text: bytes | memoryview | None = None
        if parsed is not None:
            # (a long one spliced into the upstream request, as a chat body's history is)
            text = jsonio.spliced_history(parsed.messages_text)
        if text is None and lease is not None:
            text = lease.messages_text
        if text is None and lease is not None and lease.big:
            text = await self.gateway.intake.offload(lease, jsonio.dumps, messages)
        elif text is None:
            text = jsonio.dumps(messages)
        turn.task = asyncio.create_task(
            self.runner.run(record, turn, TurnRequest(body, messages, text, parsed))
        )
        turn.task.add_done_callback(_retrieve)
        record.turns.start(turn)
        return turn

    async def _stream(
        self, turn: Turn, body: dict[str, Any], parsed: ParsedRequest | None = None
    ) -> Response:
        """Answer a streaming request from the turn's event log (see the module doc)."""
        keepalive_s = self.gateway.config.connections.stream_keepalive_s
        log: EventLog = turn.events
        log.followers += 1  # from here until _left: the log keeps its events for us
        if not log.events and not turn.task.done():
            await log.wait(keepalive_s)  # the first chunk, the end, or one interval
        if turn.task.done() and not log.events:
            _left(turn)
            if turn.task.cancelled():
                raise ApiError(
                    404, "rollout is not registered", "not_found", code="rollout_not_found"
                )
            turn.task.result()  # a failure keeps its status code
        if parsed is not None:
            relay = self._relay_dialect(turn, parsed, keepalive_s)
            return _TurnStream(relay, on_close=lambda: _left(turn))
        return _TurnStream(self._relay(turn, body, keepalive_s), on_close=lambda: _left(turn))

    async def _relay(
        self, turn: Turn, body: dict[str, Any], keepalive_s: float
    ) -> AsyncIterator[bytes]:
        log: EventLog = turn.events
        async for event in log.follow(keepalive_s):
            yield event
        try:
            answer = await turn.task
        except ApiError as exc:
            yield error_event(exc.message, exc.code or "upstream_error")
            yield DONE_EVENT
            return
        except asyncio.CancelledError:
            yield error_event("rollout is not registered", "rollout_not_found")
            yield DONE_EVENT
            return
        except Exception:
            # The stream has started: no 500 to send, but it is counted like one.
            self.gateway.metrics.internal_errors.inc()
            logger.exception("turn failed")
            yield error_event("internal gateway error", "internal_error")
            yield DONE_EVENT
            return
        if log.relayed:  # the chunks went out as the engine sent them
            yield DONE_EVENT
        else:  # the answer (the agent's view) re-encoded as chunks
            if isinstance(answer, bytes):
                answer = jsonio.loads_lenient(answer)
            events = iter_completion_sse(answer, include_usage=wants_usage(body))
            for event in guard_sse(events):
                yield event
        turn.delivered = True

    async def _relay_dialect(
        self, turn: Turn, parsed: ParsedRequest, keepalive_s: float
    ) -> AsyncIterator[bytes]:
        """The dialect's events of the turn as they come, then its closing events (or
        the whole answer's stream when the engine answered whole), or its error event."""
        assert isinstance(turn, DialectTurn) and turn.renderer is not None
        log: EventLog = turn.events
        dialect = dialect_named(parsed.dialect)
        async for event in log.follow(keepalive_s, dialect.keepalive):
            yield event
        try:
            answer = await turn.task
        except ApiError as exc:
            yield turn.renderer.error(as_gateway_error(exc))
            return
        except asyncio.CancelledError:
            yield turn.renderer.error(
                GatewayError(404, "rollout is not registered", "rollout_not_found", "not_found")
            )
            return
        except Exception:
            # The stream has started: no 500 to send, but it is counted like one.
            self.gateway.metrics.internal_errors.inc()
            logger.exception("turn failed")
            yield turn.renderer.error(
                GatewayError(500, "internal gateway error", "internal_error", "internal_error")
            )
            return
        if log.relayed:  # the events went out as the engine sent its chunks
            yield turn.closing
        else:  # an answer the engine gave whole, as the dialect's stream
            if isinstance(answer, bytes):
                answer = jsonio.loads_lenient(answer)
            yield dialect.stream(parsed).whole(answer)
        turn.delivered = True

    async def _parse(
        self, dialect: Dialect, body: dict[str, Any], record: RolloutRecord, lease: Any
    ) -> ParsedRequest:
        """``body`` as the turn runs it (raises the dialect's ``RequestError``): only what
        is new since the rollout's previous request is translated (its memo)."""
        text = None
        if lease is not None:
            text = lease.conversation
            if text is None and lease.messages_text is not None:  # made for dialects only
                messages_text = bytes(lease.messages_text)  # (the chat turn's is a view)
                text = jsonio.ConversationText("messages", messages_text, 0, 0)
        parse = functools.partial(dialect.parse, body, record.dialect_memo, text)
        parsed = await self.gateway.intake.offload(lease, parse)
        record.dialect_memo = parsed.memo
        max_messages = self.gateway.config.limits.max_messages
        if max_messages is not None and len(parsed.messages) > max_messages:
            validate_messages(parsed.body, max_messages)  # its refusal, as chat's
        return parsed

    @staticmethod
    async def _await(turn: Turn, request: AgentRequest) -> dict[str, Any] | bytes:
        if not turn.task.done():
            # Listen for the agent hanging up in this task; the turn's end interrupts that
            # (no watcher task and no asyncio.wait per turn).
            async with Interrupt(turn.task) as ended:
                await request.disconnected()
            if not ended.fired:
                raise ClientGone
        if turn.task.cancelled():
            raise ApiError(404, "rollout is not registered", "not_found", code="rollout_not_found")
        return turn.task.result()


def _chat_answer(answer: dict[str, Any] | bytes, body: dict[str, Any]) -> Response:
    """A chat request's answer: the turn's (the agent's view, see
    :func:`~.turn_runner.TurnRunner.run`), whole or as a stream of chunks."""
    completion: Any = answer
    if isinstance(answer, bytes):
        if not body.get("stream"):
            return Response(answer, media_type="application/json")
        completion = jsonio.loads_lenient(answer)  # an idempotency-key replay, streamed
    if body.get("stream"):
        events: Iterator[bytes] = iter_completion_sse(completion, include_usage=wants_usage(body))
        return StreamingResponse(
            _aiter(guard_sse(events)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        return JSONBytesResponse(completion)
    except TypeError:  # orjson's JSONEncodeError: an answer nested deeper than it writes
        raise ApiError(502, "upstream answer is malformed", "upstream_error") from None


def _left(turn: Turn) -> None:
    """A streaming waiter's response ended: it no longer waits (delivered or not), and
    no longer needs the turn's event log."""
    turn.waiters -= 1
    turn.events.release()


class _TurnStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (Starlette stops
    iterating the body when the client disconnects but does not close the generator)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _aiter(events: Iterator[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


__all__ = ["ChatTurns", "ClientGone"]
