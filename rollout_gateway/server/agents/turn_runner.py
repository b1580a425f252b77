"""One turn of a rollout, from its admission to its recorded answer: :class:`TurnRunner`.

The runner takes a request already parsed (a :class:`TurnRequest`: the chat form of the
agent's body, whatever its dialect) and returns the answer (the agent's view of the
engine's completion) or raises the turn's refusal; it knows no web framework. The edge
(:mod:`.chat`: reading the body, matching retries, answering in the agent's dialect)
starts it as the turn's task. Under the rollout's lock and its claim in the store, a
turn is admitted under the rollout's budgets (:mod:`.limits`), calls the engine
(:mod:`~rollout_gateway.server.engines.turn`) and is counted and kept by the record's
owner (:mod:`~rollout_gateway.server.state.ledger`), durable before the agent gets it.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_gateway.server.agents.dialect_turns import DialectTurn
from rollout_gateway.server.agents.limits import TurnRefused, budget_bound, check_turn_allowed
from rollout_gateway.server.dialects.base import ParsedRequest
from rollout_gateway.server.dialects.routes import dialect_named
from rollout_gateway.server.engines.turn import (
    EngineResult,
    EngineTurn,
    agent_answer,
    context_overflow_error,
    prepare_upstream_body,
)
from rollout_gateway.server.engines.upstream import UpstreamError
from rollout_gateway.server.engines.upstream_request import (
    agent_sampling,
    build_upstream_request,
    dropped_field_facts,
    max_tokens_to_send,
    requested_max_tokens,
)
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.responses import ApiError
from rollout_gateway.server.recording.history import HistoryMatch
from rollout_gateway.server.recording.prompt_ids import IdsText, answer_ids, id_count
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


# Not frozen: made every turn, and a frozen dataclass's constructor costs several
# times a plain one's (issue 33).
@dataclass(slots=True)
class TurnRequest:
    """What a turn runs: the agent's body in chat form (``body``: the chat request, or
    what a dialect's request translates to), its ``messages`` and their JSON text
    (written once: the history check and the upstream request share it), and the
    dialect's parse (``None`` for a chat request)."""

    body: dict[str, Any]
    messages: list[Any]
    messages_text: bytes | memoryview
    parsed: ParsedRequest | None = None


class TurnRunner:
    """Runs the turns of every rollout of one gateway (:meth:`run`)."""

    def __init__(self, gateway: GatewayContext) -> None:
        self.gateway = gateway

    async def run(
        self, record: RolloutRecord, turn: Turn, request: TurnRequest
    ) -> dict[str, Any] | bytes:
        """Run ``turn`` of ``record``: under the rollout's lock (its turns one at a time,
        in order) and its claim in the store; returns the answer (the agent's view) or
        raises the refusal (:class:`~rollout_gateway.server.http.responses.ApiError`)."""
        gateway = self.gateway
        try:
            async with record.lock:  # turns of one rollout run one at a time, in order
                return await self._claimed_turn(record, turn, request)
        except StoreError as exc:
            raise store_refusal(exc, record.rollout_id) from None
        finally:
            if turn.events is not None:
                turn.events.close()
            record.turns.finish(turn)
            gateway.registry.touch(record)

    async def _claimed_turn(
        self, record: RolloutRecord, turn: Turn, request: TurnRequest
    ) -> dict[str, Any] | bytes:
        """The turn under the rollout's claim in the store (one turn of a rollout at a
        time across gateways; the record brought up to date first)."""
        rollouts = self.gateway.rollouts
        if not record.live:
            raise _not_registered(record)
        # A copy the coordinator vouches for (a gateway alone on its store) takes no
        # claim and gives none back: no store call, not even an empty one, per turn.
        claimed = not rollouts.vouches_for(record)
        if claimed:
            await rollouts.claim(record)
        answered = False
        try:
            answer: dict[str, Any] | bytes | None = None
            # A vouched copy's tracker holds every turn this rollout answered: when it has
            # the last, it matched this request already. Any other copy asks the store
            # (another gateway may have answered a turn this one never saw).
            if claimed or record.turns.last is None:
                answer = await rollouts.repeated_answer(
                    record, turn.fingerprint, turn.idempotency_key, is_retry=turn.is_retry
                )
            if answer is not None:  # answered before a restart, or by another gateway
                self.gateway.metrics.deduplicated_requests.inc()
                logger.info("rollout=%s retried request gets its stored answer", record.rollout_id)
            else:
                answer = await self._locked_turn(record, turn, request)
            answered = True
            return answer
        finally:
            # Whether the answer goes to a client still connected (what a gateway that
            # takes this rollout's next turn needs to know: see _admit).
            if claimed:
                delivered = turn.waiters > 0 if answered else None
                await rollouts.release(record, delivered=delivered)

    async def _locked_turn(
        self, record: RolloutRecord, turn: Turn, request: TurnRequest
    ) -> dict[str, Any] | bytes:
        """The turn itself, the rollout claimed: admitted under its limits, the engine
        called, the step and the answer recorded (durable before the agent gets it)."""
        gateway = self.gateway
        start = time.perf_counter()
        if self._answer_lost(record):  # it is not a turn the agent saw: taken back
            self.gateway.metrics.abandoned_turns.inc()
            await gateway.ledger.abandon_last(record)  # kept even if this turn is lost
        body = request.body
        try:
            history, new_bytes = self._admit(
                record, request.messages, request.messages_text, body.get("stop")
            )
        except TurnRefused as exc:
            await gateway.ledger.refuse(record, exc.reason)
            self.tell_refusal(record, exc)
            raise
        gateway.registry.touch(record)
        call = await self._engine_turn(record, turn, request, history)
        upstream = gateway.pool.get(record.upstream)
        emit = turn.events.append if turn.events is not None else None
        try:
            result = await call.call(emit)
        except UpstreamError as exc:
            raise await self._failed(record, call, exc) from None
        if result.relayed:
            turn.events.relayed = True
            if isinstance(turn, DialectTurn) and turn.renderer is not None:
                turn.closing = turn.renderer.finish(result.completion)
        answer = await self._commit(record, turn, call, result, new_bytes, body)
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

    async def _engine_turn(
        self, record: RolloutRecord, turn: Turn, request: TurnRequest, history: HistoryMatch
    ) -> EngineTurn:
        """The engine call of the turn: the upstream request (its ``max_tokens`` bounded:
        :mod:`~rollout_gateway.server.engines.upstream_request`) and, for a dialect turn,
        its stream renderer and recorded answer."""
        gateway = self.gateway
        body, parsed = request.body, request.parsed
        engine = await gateway.engine(record.upstream)
        window = engine.max_model_len
        max_tokens = max_tokens_to_send(
            requested_max_tokens(body, record.flat_sampling),
            budget_bound(record, extends_history=bool(history.shared), window=window),
            window,
        )
        upstream_body = build_upstream_request(
            body,
            model=record.model,
            sampling_params=record.flat_sampling,
            max_tokens=max_tokens,
            messages_text=request.messages_text,
        )
        call = EngineTurn(
            gateway.pool,
            gateway.policy,
            gateway.token_in,
            record,
            body,
            request.messages,
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
        return call

    async def _failed(
        self, record: RolloutRecord, call: EngineTurn, exc: UpstreamError
    ) -> ApiError:
        """The refusal of a turn whose engine call failed, its failure recorded: a prompt
        the engine's context cannot hold ends the rollout (truncated), anything else is
        kept in ``failed_turns`` and the rollout goes on."""
        gateway = self.gateway
        upstream = gateway.pool.get(record.upstream)
        gateway.metrics.upstream_errors.inc(upstream.label, exc.kind)
        logger.warning(
            "rollout=%s turn=%d upstream=%s error=%s: %s",
            record.rollout_id, call.number, upstream.label, exc.kind, exc.detail,
        )  # fmt: skip
        if call.overflowed:
            await gateway.ledger.record_overflow(record)  # its step: the prompt refused
            # The rollout is over (recorded truncated): the env stops its agent.
            gateway.exit_board.refused(record.rollout_id, "context_length_exceeded")
            return context_overflow_error(exc)
        assert call.failed_turn is not None  # (every other failure of the call is noted)
        await gateway.ledger.note_failure(record, call.failed_turn)
        return ApiError(exc.status_code, exc.message, "upstream_error")

    async def _commit(
        self,
        record: RolloutRecord,
        turn: Turn,
        call: EngineTurn,
        result: EngineResult,
        new_bytes: int,
        body: dict[str, Any],
    ) -> dict[str, Any] | bytes:
        """Count the turn and keep its answer (durable before the agent gets it: a retry
        after a crash gets this very answer); returns the answer."""
        gateway = self.gateway
        use = _turn_use(record, call, result, new_bytes)
        answer = _answer_of(result, body, ids_read=record.recorder.last_step.tokens is not None)
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
        self,
        record: RolloutRecord,
        messages: list[Any],
        messages_text: bytes | memoryview,
        stop: Any = None,
    ) -> tuple[HistoryMatch, int]:
        """Whether the rollout may take this turn (raises :class:`TurnRefused` if not).

        Returns how the request extends the recorded history (the messages it shares) and
        the bytes the turn stores for the agent: its new messages, and its ``stop``
        (recorded in ``extras.sampling``; an agent can send megabytes of it each turn).
        """
        history = record.recorder.match_history(messages, messages_text)
        shared = history.shared
        # Counted as stored: only the fields the trajectory keeps.
        new_bytes = len(jsonio.dumps(history.new_messages(messages)))  # (the recorder's too)
        if stop is not None:
            new_bytes += len(jsonio.dumps(stop))
        check_turn_allowed(record, extends_history=bool(shared), new_message_bytes=new_bytes)
        return history, new_bytes

    def tell_refusal(self, record: RolloutRecord, exc: ApiError) -> None:
        """Count a refused turn, and tell it on the exit channel too: whatever the agent
        does with the refusal (agent frameworks retry some 4xx for minutes), the env
        stops it."""
        self.gateway.metrics.refused_turns.inc(str(exc.code))
        self.gateway.exit_board.refused(record.rollout_id, str(exc.code))


def _id_count(ids_json: IdsText | None) -> int | None:
    """How many ids a JSON id array holds, without parsing it (the prompt is kept as text)."""
    return None if ids_json is None else id_count(ids_json)


def _completion_tokens(completion: dict[str, Any], completion_ids: list[int] | None) -> int:
    if completion_ids is not None:
        return len(completion_ids)
    usage = completion.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and tokens > 0 else 0


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


def _answer_of(
    result: EngineResult, body: dict[str, Any], *, ids_read: bool
) -> dict[str, Any] | bytes:
    """The answer, also what a retry replays (kept until the next turn).

    The engine's bytes as they are when the agent asked for everything the gateway asked
    for, else the agent's view (without the prompt's ids unless it asked). ``ids_read``:
    the turn's step has the prompt's ids (read from ``result.prompt_ids_json``).
    """
    completion = result.completion
    wants_ids = bool(body.get("return_token_ids"))
    everything = wants_ids and body.get("logprobs") and body.get("include_reasoning") is not False
    if everything and not body.get("stream") and result.raw is not None and result.strict:
        return result.raw
    if wants_ids and result.prompt_ids_json is not None:
        try:
            completion["prompt_token_ids"] = answer_ids(result.prompt_ids_json, ids_read)
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


__all__ = ["TurnRequest", "TurnRunner", "store_refusal"]
