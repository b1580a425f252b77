"""The data plane: one chat turn of a rollout, from the agent's request to its answer.

A request is matched against the rollout's turns first (:mod:`.dedupe`): a retry waits
for the turn it repeats. A new request becomes a turn task; turns of one rollout run one
at a time, in order, under the rollout's lock, and each checks the rollout's budgets
(:mod:`.limits`) before it calls the upstream. The turn task is not the request's: when
the agent disconnects the turn still finishes and is recorded, and a retry gets its
answer; if nobody ever gets it, it is recorded as abandoned when the agent moves on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rollout_gateway.protocol import IDEMPOTENCY_KEY_HEADER, SDK_RETRY_COUNT_HEADER
from rollout_gateway.server import jsonio
from rollout_gateway.server.dedupe import Turn, body_fingerprint
from rollout_gateway.server.jsonio import JSONBytesResponse
from rollout_gateway.server.limits import check_turn_allowed, max_tokens_allowed
from rollout_gateway.server.limits_v1 import turn_token_counts
from rollout_gateway.server.registry import RolloutRecord
from rollout_gateway.server.responses import (
    ApiError,
    parse_json_object,
    read_body,
    validate_messages,
)
from rollout_gateway.server.sse import guard_sse, iter_completion_sse
from rollout_gateway.server.turns import (
    agent_view,
    build_upstream_request,
    dropped_agent_fields,
    read_turn,
)
from rollout_gateway.server.upstream import UpstreamError

if TYPE_CHECKING:
    from rollout_gateway.server.app import Gateway

logger = logging.getLogger("rollout_gateway.server")


class ClientGone(Exception):
    """The agent closed its connection before its answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _completion_tokens(completion: dict[str, Any], completion_ids: list[int] | None) -> int:
    if completion_ids is not None:
        return len(completion_ids)
    usage = completion.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and tokens > 0 else 0


def _is_retry(headers: Mapping[str, str]) -> bool:
    count = headers.get(SDK_RETRY_COUNT_HEADER, "0").strip()
    return count.isdigit() and int(count) > 0


def _retrieve(task: asyncio.Task[Any]) -> None:
    # Nobody may await a turn whose agent left: fetch its exception so asyncio does not
    # log "Task exception was never retrieved".
    if not task.cancelled():
        task.exception()


class ChatTurns:
    """Chat turns of every rollout of one :class:`~rollout_gateway.server.app.Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def handle(self, request: Request, record: RolloutRecord) -> Response:
        """Answer one chat request of ``record`` (authenticated already)."""
        config = self.gateway.config
        raw = await read_body(request, config.max_body_bytes)
        body = await parse_json_object(raw)
        messages = validate_messages(body)
        fingerprint = body_fingerprint(raw)
        idempotency_key = request.headers.get(IDEMPOTENCY_KEY_HEADER)
        turn = None
        if record.status != "cancelled":  # a cancelled rollout answers nothing more
            turn = record.turns.match(
                fingerprint, idempotency_key, is_retry=_is_retry(request.headers)
            )
        if turn is not None:
            self.gateway.metrics.deduplicated_requests.inc()
            logger.info("rollout=%s retried request joins its earlier turn", record.rollout_id)
        else:
            if len(record.turns.pending) >= config.max_pending_turns:
                raise ApiError(
                    429,
                    "too many concurrent requests for this rollout",
                    "rate_limit_error",
                    code="too_many_pending_turns",
                )
            turn = Turn(fingerprint, idempotency_key)
            turn.task = asyncio.create_task(self._run_turn(record, turn, body, messages))
            turn.task.add_done_callback(_retrieve)
            record.turns.start(turn)
        turn.waiters += 1
        try:
            completion = await self._await(turn, request)
        except ClientGone:
            turn.waiters -= 1
            logger.info("rollout=%s agent disconnected before its answer", record.rollout_id)
            return Response(status_code=499)
        turn.delivered = True
        answer = agent_view(completion, body)
        if body.get("stream"):
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            events: Iterator[bytes] = iter_completion_sse(answer, include_usage=include_usage)
            return StreamingResponse(
                _aiter(guard_sse(events)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONBytesResponse(answer)

    @staticmethod
    async def _await(turn: Turn, request: Request) -> dict[str, Any]:
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({turn.task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if turn.task not in done:
            raise ClientGone
        if turn.task.cancelled():
            raise ApiError(404, "rollout is not registered", "not_found", code="rollout_not_found")
        return turn.task.result()

    async def _run_turn(
        self, record: RolloutRecord, turn: Turn, body: dict[str, Any], messages: list[Any]
    ) -> dict[str, Any]:
        gateway = self.gateway
        try:
            async with record.lock:  # turns of one rollout run one at a time, in order
                return await self._locked_turn(record, turn, body, messages)
        finally:
            record.turns.finish(turn)
            gateway.registry.touch(record)

    async def _locked_turn(
        self, record: RolloutRecord, turn: Turn, body: dict[str, Any], messages: list[Any]
    ) -> dict[str, Any]:
        gateway = self.gateway
        start = time.perf_counter()
        if not record.live:
            raise ApiError(
                404, f"rollout {record.rollout_id} is not registered", "not_found",
                code="rollout_not_found",
            )  # fmt: skip
        last = record.turns.last
        if last is not None and last.recorded and not last.delivered and last.waiters <= 0:
            # The previous answer reached nobody and the agent moved on: not a turn it saw.
            record.recorder.abandon_last()
            record.num_turns -= 1
            last.delivered = True  # handled
            if record.status == "completed" and record.truncation_reason is None:
                record.status = "active"
            gateway.metrics.abandoned_turns.inc()
        shared = record.recorder.shared_messages(messages)
        new_bytes = len(jsonio.dumps(messages[shared or 0 :]))
        extends = bool(shared)
        try:
            check_turn_allowed(record, extends_history=extends, new_message_bytes=new_bytes)
        except ApiError as exc:
            gateway.metrics.refused_turns.inc(str(exc.code))
            raise
        gateway.registry.touch(record)
        dropped = dropped_agent_fields(body)
        upstream_body = build_upstream_request(
            body,
            model=record.model,
            sampling_params=record.sampling_params,
            max_tokens_bound=max_tokens_allowed(record, extends_history=extends),
        )
        upstream = gateway.pool.get(record.upstream)
        try:
            completion, upstream_s = await gateway.pool.chat(record.upstream, upstream_body)
        except UpstreamError as exc:
            gateway.metrics.upstream_errors.inc(upstream.label, exc.kind)
            logger.warning(
                "rollout=%s turn=%d upstream=%s error=%s: %s",
                record.rollout_id, record.num_turns + 1, upstream.label, exc.kind, exc.detail,
            )  # fmt: skip
            raise ApiError(exc.status_code, exc.message, "upstream_error") from None
        result = read_turn(completion)
        extras: dict[str, Any] = {"dropped_fields": dropped} if dropped else {}
        record.recorder.record(
            messages,
            result.completion,
            prompt_ids=result.prompt_ids,
            completion_ids=result.completion_ids,
            completion_logprobs=result.completion_logprobs,
            finish_reason=result.finish_reason,
            total_tokens=result.total_tokens,
            shared=shared,
            extras=extras,
        )
        turn.recorded = True
        record.message_bytes += new_bytes
        record.completion_tokens += _completion_tokens(completion, result.completion_ids)
        record.num_turns += 1
        if record.token_budget is not None:  # verifiers v1's token caps
            record.token_budget.add_turn(
                *turn_token_counts(completion, result.prompt_ids, result.completion_ids)
            )
        if record.at_max_turns and record.status == "active":
            record.status = "completed"
        gateway.metrics.turns.inc(upstream.label)
        gateway.metrics.upstream_latency.observe(upstream_s, upstream.label)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "rollout=%s turn=%d latency_ms=%.1f upstream_ms=%.1f finish=%s",
                record.rollout_id, record.num_turns, (time.perf_counter() - start) * 1000,
                upstream_s * 1000, result.finish_reason,
            )  # fmt: skip
        return completion


async def _aiter(events: Iterator[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


__all__ = ["ChatTurns", "ClientGone"]
