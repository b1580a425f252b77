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
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from rollout_gateway.interrupt import Interrupt
from rollout_gateway.server.agents.limits import (
    NO_RETRY_HEADERS,
    TurnRefused,
    budget_bound,
    check_takes_turn,
    check_turn_allowed,
)
from rollout_gateway.server.agents.request import AgentRequest
from rollout_gateway.server.agents.sse import (
    DONE_EVENT,
    error_event,
    guard_sse,
    iter_completion_sse,
)
from rollout_gateway.server.dialects.anthropic import AnthropicDialect, estimated_input_tokens
from rollout_gateway.server.dialects.base import Dialect, ParsedRequest, StreamRenderer
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.dialects.routes import dialect_named
from rollout_gateway.server.engines.streaming import EventLog
from rollout_gateway.server.engines.turn import (
    EngineResult,
    EngineTurn,
    agent_answer,
    context_overflow_error,
    prepare_upstream_body,
    wants_usage,
)
from rollout_gateway.server.engines.upstream import UpstreamError
from rollout_gateway.server.engines.upstream_request import (
    agent_sampling,
    build_upstream_request,
    drop_unread_values,
    dropped_field_facts,
    max_tokens_to_send,
    requested_max_tokens,
    validate_max_tokens,
)
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.jsonio import JSONBytesResponse
from rollout_gateway.server.http.responses import (
    ApiError,
    ClientGone,
    parse_json_object,
    validate_answer_flags,
    validate_messages,
)
from rollout_gateway.server.recording.history import HistoryMatch, recorded_message
from rollout_gateway.server.state.dedupe import Turn
from rollout_gateway.server.state.ledger import TurnUse
from rollout_gateway.server.state.limits_v1 import turn_token_counts
from rollout_gateway.server.state.registry import RolloutRecord
from rollout_gateway.server.state.store import (
    AnswerKey,
    StoreError,
    TurnAnswer,
    UnknownRolloutError,
)

if TYPE_CHECKING:
    from rollout_gateway.server.context import GatewayContext

logger = logging.getLogger("rollout_gateway.server")

#: Requests that may wait for one turn at once: the original and its retries (an SDK
#: retries two or three times). Each holds a connection until the turn ends, so without
#: a bound one agent repeating a slow turn could hold every connection of the gateway.
MAX_TURN_WAITERS = 8

#: The chat completions dialect: the gateway's own path, its bytes as they always were.
CHAT: Dialect = dialect_named("chat")


@dataclass(eq=False)
class DialectTurn(Turn):
    """A turn asked in another dialect than chat: the renderer of its stream (each
    engine chunk becomes the dialect's events as it comes) and the events that close
    it, written once the answer is in (every waiter relays the same ones)."""

    renderer: StreamRenderer | None = None
    closing: bytes = b""


def dialect_fingerprint(dialect: Dialect, fingerprint: bytes) -> bytes:
    """The fingerprint of a body sent in ``dialect`` (a body can be valid in two
    dialects: a chat request must not join a Messages turn). Chat's is the body's own."""
    if dialect is CHAT:
        return fingerprint
    digest = hashlib.blake2b(fingerprint, digest_size=len(fingerprint) or 16)
    digest.update(dialect.name.encode())
    return digest.digest()


def as_gateway_error(exc: ApiError) -> GatewayError:
    """A refusal of the turn as every dialect renders it."""
    return GatewayError(exc.status_code, exc.message, exc.code, exc.error_type, None, exc.headers)


def _id_count(ids_json: bytes | None) -> int | None:
    """How many ids a JSON id array holds, without parsing it (the prompt is kept as text)."""
    if ids_json is None:
        return None
    body = ids_json.strip()[1:-1].strip()
    return body.count(b",") + 1 if body else 0


def _completion_tokens(completion: dict[str, Any], completion_ids: list[int] | None) -> int:
    if completion_ids is not None:
        return len(completion_ids)
    usage = completion.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and tokens > 0 else 0


def _retrieve(task: asyncio.Task[Any]) -> None:
    # Nobody may await a turn whose agent left: fetch its exception so asyncio does not
    # log "Task exception was never retrieved".
    if not task.cancelled():
        task.exception()


class ChatTurns:
    """Chat turns of every rollout of one gateway."""

    def __init__(self, gateway: GatewayContext) -> None:
        self.gateway = gateway

    async def handle(
        self, request: AgentRequest, record: RolloutRecord, dialect: Dialect = CHAT
    ) -> Response:
        """Answer one request of ``record`` (authenticated already) sent in ``dialect``."""
        config = self.gateway.config
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
        big = lease.big
        fingerprint_of = self.gateway.rollouts.fingerprint  # keyed with the store's secret
        fingerprint = (
            await intake.offload(lease, fingerprint_of, raw) if big else fingerprint_of(raw)
        )
        if dialect is not CHAT:
            fingerprint = dialect_fingerprint(dialect, fingerprint)
        idempotency_key, is_retry = request.idempotency_key, request.is_retry
        if record.status != "active":  # may be refused before its body is parsed
            try:
                check_takes_turn(
                    record, self.gateway.rollouts, fingerprint, idempotency_key,
                    is_retry=is_retry,
                )  # fmt: skip
            except TurnRefused as exc:
                await self.gateway.ledger.refuse(record, exc.reason)
                self._tell_refusal(record, exc)
                raise
        body = await parse_json_object(raw, lambda raw: intake.parse(lease, raw))
        del raw  # only the parsed body lives on, without what is never read
        lease.drop_raw()
        parsed: ParsedRequest | None = None
        if dialect is CHAT:
            drop_unread_values(body)
            messages = validate_messages(body, config.limits.max_messages)
            validate_answer_flags(body)
        else:
            parsed = await self._parse(dialect, body, record, lease)
            body, messages = parsed.body, parsed.messages
        validate_max_tokens(body)
        stream = bool(body.get("stream"))
        turn = None
        if record.status != "cancelled":  # a cancelled rollout answers nothing more
            turn = record.turns.match(fingerprint, idempotency_key, is_retry=is_retry)
        if turn is not None:
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
        else:
            if len(record.turns.pending) >= config.limits.max_pending_turns:
                raise ApiError(
                    429,
                    "too many concurrent requests for this rollout",
                    "rate_limit_error",
                    code="too_many_pending_turns",
                )
            if parsed is None:
                turn = Turn(fingerprint, idempotency_key, is_retry)
            else:
                renderer = dialect.stream(parsed) if stream else None
                turn = DialectTurn(fingerprint, idempotency_key, is_retry, renderer=renderer)
            if stream:
                turn.events = EventLog()
            # Written now, while the parsed body is in the CPU's caches: the history check
            # and the upstream request both use this text (see recording/history.py).
            if parsed is not None:
                text = parsed.messages_text  # the dialect's parse wrote it
            elif big:
                text = await intake.offload(lease, jsonio.dumps, messages)
            else:
                text = jsonio.dumps(messages)
            turn.task = asyncio.create_task(
                self._run_turn(record, turn, body, messages, text, parsed)
            )
            turn.task.add_done_callback(_retrieve)
            record.turns.start(turn)
        turn.waiters += 1
        if stream and turn.events is not None and not turn.task.done():
            return await self._stream(turn, body, parsed)
        try:
            completion = await self._await(turn, request)
        except ClientGone:
            turn.waiters -= 1
            logger.info("rollout=%s agent disconnected before its answer", record.rollout_id)
            return Response(status_code=499)
        turn.delivered = True
        if parsed is not None:
            return _dialect_answer(dialect, parsed, completion)
        answer = completion  # already the agent's view (see _locked_turn)
        if isinstance(answer, bytes):
            if not body.get("stream"):
                return Response(answer, media_type="application/json")
            answer = jsonio.loads_lenient(answer)  # an idempotency-key replay, streamed
        if body.get("stream"):
            events: Iterator[bytes] = iter_completion_sse(answer, include_usage=wants_usage(body))
            return StreamingResponse(
                _aiter(guard_sse(events)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            return JSONBytesResponse(answer)
        except TypeError:  # orjson's JSONEncodeError: an answer nested deeper than it writes
            raise ApiError(502, "upstream answer is malformed", "upstream_error") from None

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
        parse = functools.partial(dialect.parse, body, record.dialect_memo)
        parsed = await self.gateway.intake.offload(lease, parse)
        record.dialect_memo = parsed.memo
        max_messages = self.gateway.config.limits.max_messages
        if max_messages is not None and len(parsed.messages) > max_messages:
            validate_messages(parsed.body, max_messages)  # its refusal, as chat's
        return parsed

    async def count_tokens(
        self, request: AgentRequest, record: RolloutRecord, dialect: Dialect
    ) -> Response:
        """A dialect's token count (``/v1/messages/count_tokens``): answered within the
        rollout's body budgets, never recorded, no turn counted."""
        assert isinstance(dialect, AnthropicDialect)
        intake = self.gateway.intake
        lease = request.lease = intake.lease(record.rollout_id)  # the endpoint releases it
        try:
            raw = await intake.read(
                lease, request.receive, request.content_length, request.read_timer
            )
        except ClientGone:
            return Response(status_code=499)
        body = await parse_json_object(raw, lambda raw: intake.parse(lease, raw))
        del raw
        lease.drop_raw()
        parsed = await intake.offload(lease, dialect.parse_count, body)
        count = await self._count(record, parsed)
        return JSONBytesResponse(dialect.render_count(count))

    async def _count(self, record: RolloutRecord, parsed: ParsedRequest) -> int:
        """The request's prompt tokens: the renderer's count in token-in mode, vLLM's own
        (``POST /tokenize`` at its root) in front of vLLM, else an estimate from its size
        (:func:`estimated_input_tokens`)."""
        gateway = self.gateway
        tools = parsed.body.get("tools")
        try:
            if gateway.token_in is not None:
                return await gateway.token_in.count_prompt(parsed.messages, tools)
            if (await gateway.engine(record.upstream)).kind == "vllm":
                return await self._engine_count(record, parsed.messages, tools)
        except Exception as exc:  # an engine or renderer that cannot say: the estimate
            logger.info("rollout=%s count_tokens estimated: %r", record.rollout_id, exc)
        return estimated_input_tokens(parsed)

    async def _engine_count(self, record: RolloutRecord, messages: list[Any], tools: Any) -> int:
        upstream = self.gateway.pool.get(record.upstream)
        root = upstream.base_url.rstrip("/").removesuffix("/v1")
        body: dict[str, Any] = {
            "model": record.model,
            "messages": messages,
            "add_generation_prompt": True,
        }
        if tools:
            body["tools"] = tools
        async with asyncio.timeout(self.gateway.pool.timeout_s):
            answer = await upstream.http.post(f"{root}/tokenize", jsonio.dumps(body))
        count = jsonio.loads(answer.content).get("count") if answer.status_code == 200 else None
        if not isinstance(count, int):
            raise ValueError(f"/tokenize answered {answer.status_code}")
        return count

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

    async def _run_turn(
        self,
        record: RolloutRecord,
        turn: Turn,
        body: dict[str, Any],
        messages: list[Any],
        messages_text: bytes,
        parsed: ParsedRequest | None = None,
    ) -> dict[str, Any] | bytes:
        gateway = self.gateway
        try:
            async with record.lock:  # turns of one rollout run one at a time, in order
                return await self._claimed_turn(record, turn, body, messages, messages_text, parsed)
        except StoreError as exc:
            raise store_refusal(exc, record.rollout_id) from None
        finally:
            if turn.events is not None:
                turn.events.close()
            record.turns.finish(turn)
            gateway.registry.touch(record)

    async def _claimed_turn(
        self,
        record: RolloutRecord,
        turn: Turn,
        body: dict[str, Any],
        messages: list[Any],
        messages_text: bytes,
        parsed: ParsedRequest | None,
    ) -> dict[str, Any] | bytes:
        """The turn under the rollout's claim in the store (one turn of a rollout at a
        time across gateways; the record brought up to date first)."""
        rollouts = self.gateway.rollouts
        if not record.live:
            raise _not_registered(record)
        await rollouts.claim(record)
        answered = False
        try:
            answer: dict[str, Any] | bytes | None = await rollouts.repeated_answer(
                record, turn.fingerprint, turn.idempotency_key, is_retry=turn.is_retry
            )
            if answer is not None:  # answered before a restart, or by another gateway
                self.gateway.metrics.deduplicated_requests.inc()
                logger.info("rollout=%s retried request gets its stored answer", record.rollout_id)
            else:
                answer = await self._locked_turn(
                    record, turn, body, messages, messages_text, parsed
                )
            answered = True
            return answer
        finally:
            # Whether the answer goes to a client still connected (what a gateway that
            # takes this rollout's next turn needs to know: see _admit).
            delivered = turn.waiters > 0 if answered else None
            await rollouts.release(record, delivered=delivered)

    async def _locked_turn(
        self,
        record: RolloutRecord,
        turn: Turn,
        body: dict[str, Any],
        messages: list[Any],
        messages_text: bytes,
        parsed: ParsedRequest | None,
    ) -> dict[str, Any] | bytes:
        gateway = self.gateway
        start = time.perf_counter()
        if self._answer_lost(record):  # it is not a turn the agent saw: taken back
            self.gateway.metrics.abandoned_turns.inc()
            await gateway.ledger.abandon_last(record)  # kept even if this turn is lost
        try:
            history, new_bytes = self._admit(record, messages, messages_text, body.get("stop"))
        except TurnRefused as exc:
            await gateway.ledger.refuse(record, exc.reason)
            self._tell_refusal(record, exc)
            raise
        extends = bool(history.shared)
        gateway.registry.touch(record)
        upstream = gateway.pool.get(record.upstream)
        engine = await gateway.engine(record.upstream)
        window = engine.max_model_len
        max_tokens = max_tokens_to_send(
            requested_max_tokens(body, record.sampling_params),
            budget_bound(record, extends_history=extends, window=window),
            window,
        )
        upstream_body = build_upstream_request(
            body,
            model=record.model,
            sampling_params=record.sampling_params,
            max_tokens=max_tokens,
            messages_text=messages_text,
        )
        call = EngineTurn(
            gateway.pool,
            gateway.policy,
            gateway.token_in,
            record,
            body,
            messages,
            prepare_upstream_body(upstream_body, record, engine),
            engine,
            history=history,
            extras=_turn_facts(body, parsed),
        )
        if parsed is not None:
            assert isinstance(turn, DialectTurn)
            call.renderer = turn.renderer
            dialect = dialect_named(parsed.dialect)
            call.recorded_answer = functools.partial(dialect.recorded_answer, request=parsed)
        emit = turn.events.append if turn.events is not None else None
        try:
            result = await call.call(emit)
        except UpstreamError as exc:
            gateway.metrics.upstream_errors.inc(upstream.label, exc.kind)
            logger.warning(
                "rollout=%s turn=%d upstream=%s error=%s: %s",
                record.rollout_id, call.number, upstream.label, exc.kind, exc.detail,
            )  # fmt: skip
            if call.overflowed:
                await gateway.ledger.record_overflow(record)  # its step: the prompt refused
                # The rollout is over (recorded truncated): the env stops its agent.
                gateway.exit_board.refused(record.rollout_id, "context_length_exceeded")
                raise context_overflow_error(exc) from None
            assert call.failed_turn is not None  # (every other failure of the call is noted)
            await gateway.ledger.note_failure(record, call.failed_turn)
            raise ApiError(exc.status_code, exc.message, "upstream_error") from None
        if result.relayed:
            turn.events.relayed = True
            if isinstance(turn, DialectTurn) and turn.renderer is not None:
                turn.closing = turn.renderer.finish(result.completion)
        use = _turn_use(record, call, result, new_bytes)
        answer = _answer_of(result, body)
        # Durable before the agent gets it: a retry after a crash gets this very answer.
        key = AnswerKey(
            turn.fingerprint, turn.idempotency_key, gateway.rollouts.wall_clock(),
            record.recorder.num_steps - 1,
        )  # fmt: skip
        without = result.raw_without_prompt_ids if answer is result.raw else None
        # (Whether it goes to a client still connected: see _admit.)
        delivered = turn.waiters > 0
        await gateway.ledger.count_turn(
            record, use, TurnAnswer(key, answer, without), delivered=delivered
        )
        turn.recorded = True
        upstream_s = call.upstream_seconds()
        gateway.metrics.turns.inc(upstream.label)
        gateway.metrics.upstream_latency.observe(upstream_s, upstream.label)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "rollout=%s turn=%d latency_ms=%.1f upstream_ms=%.1f finish=%s",
                record.rollout_id, record.num_turns, (time.perf_counter() - start) * 1000,
                upstream_s * 1000, call.finish_reason,
            )  # fmt: skip
        return answer

    @staticmethod
    def _answer_lost(record: RolloutRecord) -> bool:
        """Whether the rollout's last answer never reached its agent (it moved on without
        it), answered here or at another gateway (or one that died)."""
        if not record.live:
            raise _not_registered(record)
        last = record.turns.last
        if last is not None and last.recorded and not last.delivered and last.waiters <= 0:
            last.delivered = True  # handled
            return True
        return last is None and _answered_elsewhere_undelivered(record)

    def _admit(
        self, record: RolloutRecord, messages: list[Any], messages_text: bytes, stop: Any = None
    ) -> tuple[HistoryMatch, int]:
        """Whether the rollout may take this turn (raises :class:`TurnRefused` if not).

        Returns how the request extends the recorded history (the messages it shares) and
        the bytes the turn stores for the agent: its new messages, and its ``stop``
        (recorded in ``extras.sampling``; an agent can send megabytes of it each turn).
        """
        history = record.recorder.match_history(messages, messages_text)
        shared = history.shared
        # Counted as stored: only the fields the trajectory keeps.
        new_bytes = len(jsonio.dumps([recorded_message(m) for m in messages[shared or 0 :]]))
        if stop is not None:
            new_bytes += len(jsonio.dumps(stop))
        check_turn_allowed(record, extends_history=bool(shared), new_message_bytes=new_bytes)
        return history, new_bytes

    def _tell_refusal(self, record: RolloutRecord, exc: ApiError) -> None:
        """Count a refused turn, and tell it on the exit channel too: whatever the agent
        does with the refusal (agent frameworks retry some 4xx for minutes), the env
        stops it."""
        self.gateway.metrics.refused_turns.inc(str(exc.code))
        self.gateway.exit_board.refused(record.rollout_id, str(exc.code))


def _turn_use(
    record: RolloutRecord, call: EngineTurn, result: EngineResult, new_bytes: int
) -> TurnUse:
    """What a recorded turn used of the rollout's limits and budget."""
    completion = result.completion
    v1_tokens = None
    if record.token_budget is not None:  # verifiers v1's token caps
        prompt_tokens = _id_count(result.prompt_ids_json)
        v1_tokens = turn_token_counts(completion, prompt_tokens, call.completion_ids)
    return TurnUse(new_bytes, _completion_tokens(completion, call.completion_ids), v1_tokens)


def _turn_facts(body: dict[str, Any], parsed: ParsedRequest | None) -> dict[str, Any]:
    """What the step records of what the agent sent (``extras``): its dialect, its own
    sampling fields, what it sent that the engine did not get."""
    if parsed is not None:
        return dict(parsed.facts)
    return {
        "dialect": "chat",
        **dropped_field_facts(body),
        "agent_sampling": agent_sampling(body),
    }


def _dialect_answer(
    dialect: Dialect, parsed: ParsedRequest, answer: dict[str, Any] | bytes
) -> Response:
    """The turn's answer (the engine's completion, the agent's view) in ``dialect``:
    rendered for the request that asked (a retry's replay too), whole or as its stream."""
    completion: dict[str, Any] = (
        jsonio.loads_lenient(answer) if isinstance(answer, bytes) else answer
    )
    if parsed.stream:
        events = dialect.stream(parsed).whole(completion)
        return Response(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        return JSONBytesResponse(dialect.render(completion, parsed))
    except TypeError:  # orjson's JSONEncodeError: an answer nested deeper than it writes
        raise ApiError(502, "upstream answer is malformed", "upstream_error") from None


def _answer_of(result: EngineResult, body: dict[str, Any]) -> dict[str, Any] | bytes:
    """The answer, also what a retry replays (kept until the next turn).

    The engine's bytes as they are when the agent asked for everything the gateway asked
    for, else the agent's view (without the prompt's ids unless it asked).
    """
    completion = result.completion
    wants_ids = bool(body.get("return_token_ids"))
    everything = wants_ids and body.get("logprobs") and body.get("include_reasoning") is not False
    if everything and not body.get("stream") and result.raw is not None and result.strict:
        return result.raw
    if wants_ids and result.prompt_ids_json is not None:
        try:
            completion["prompt_token_ids"] = jsonio.loads(result.prompt_ids_json)
        except jsonio.JSONDecodeError:
            pass  # not ids JSON can carry: the step says so (tokens_error), the agent gets none
    return agent_answer(completion, body)


def _answered_elsewhere_undelivered(record: RolloutRecord) -> bool:
    """Whether the rollout's last step is an answer a gateway sharing the store gave and
    did not hand to a connected client (see :attr:`~.store.AnswerKey.delivered`)."""
    key = record.answer_key
    recorder = record.recorder
    last = recorder.num_steps - 1
    return (
        key is not None
        and not key.delivered
        and key.step == last
        and last not in recorder.abandoned_indexes()
    )


def _not_registered(record: RolloutRecord) -> ApiError:
    return ApiError(
        404, f"rollout {record.rollout_id} is not registered", "not_found",
        code="rollout_not_found",
    )  # fmt: skip


def store_refusal(exc: StoreError, rollout_id: str) -> ApiError:
    """The answer to a request the state store failed: 404 for a rollout it no longer
    holds; else a 503 the agent's SDK retries (nothing half-written was kept, and the
    retry starts from what the store holds)."""
    if isinstance(exc, UnknownRolloutError):
        return ApiError(
            404, f"rollout {rollout_id} is not registered", "not_found", code="rollout_not_found"
        )
    logger.error("rollout=%s state store failed: %s", rollout_id, exc)
    return ApiError(
        503, "the gateway's state store is unavailable; retry", "store_unavailable",
        code="store_unavailable",
    )  # fmt: skip


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


__all__ = [
    "CHAT",
    "ChatTurns",
    "ClientGone",
    "DialectTurn",
    "as_gateway_error",
    "dialect_fingerprint",
    "store_refusal",
]
