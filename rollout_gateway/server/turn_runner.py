"""One chat turn from upstream request to recorded step, streamed or not.

The runner owns the rollout's turn lock from the moment the handler passes the turn on:
the lock is released when the upstream call is over and the step recorded (or the turn
failed), never by the agent-facing response, which may never be iterated if the agent
goes away first.

Streaming (``stream: true`` from the agent):

* from vLLM the engine is streamed from (first byte to the agent as soon as the engine
  sends it) while :class:`~rollout_gateway.server.streaming.StreamAssembler` rebuilds the
  whole answer for the recorder;
* from other engines (SGLang refuses token-id flags on streamed requests) the answer is
  fetched whole and re-encoded as chunks, logprobs and ids included when asked;
* either way, while the engine is silent for ``keepalive_s`` the agent gets SSE comment
  keepalives (tunnels and proxies drop silent connections). An engine that answers an
  error before the first keepalive gets its status code passed on; after it, the error
  arrives as an SSE ``error`` event (the OpenAI SDK raises it).

An agent that disconnects mid-stream cancels the engine request (closing the upstream
stream aborts generation); that turn is not recorded, since the agent never saw it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from rollout_gateway.protocol import StepExtras, TurnError
from rollout_gateway.server.answers import EngineAnswer, read_answer
from rollout_gateway.server.engines import TOKEN_FLAG_FIELDS, EngineInfo, token_flags
from rollout_gateway.server.metrics import GatewayMetrics
from rollout_gateway.server.policy import PolicyClock
from rollout_gateway.server.registry import RolloutRecord, RolloutRegistry
from rollout_gateway.server.responses import ApiError
from rollout_gateway.server.sse import DONE_EVENT, iter_completion_sse
from rollout_gateway.server.streaming import (
    KEEPALIVE_EVENT,
    StreamAssembler,
    StreamError,
    agent_chunk,
    iter_sse_json,
    sse_error_event,
    sse_event,
)
from rollout_gateway.server.turn_seed import turn_seed
from rollout_gateway.server.turns import agent_view, flatten_sampling_params
from rollout_gateway.server.upstream import UpstreamError, UpstreamPool, raise_for_upstream_status

logger = logging.getLogger("rollout_gateway.server")

#: An engine's 400 for a prompt that does not fit its context (vLLM: "This model's
#: maximum context length is 4096 tokens..."; SGLang: "The input (N tokens) is longer
#: than the model's context length (M tokens)").
_CONTEXT_OVERFLOW_RE = re.compile(
    r"maximum context length|context length|context window|max_model_len|"
    r"maximum model length|prompt is too long",
    re.IGNORECASE,
)

#: Request fields that are not sampling settings (left out of ``extras.sampling``).
_NOT_SAMPLING = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "model",
        "stream",
        "stream_options",
        "include_reasoning",
        "response_format",
        "chat_template_kwargs",
        *TOKEN_FLAG_FIELDS,
    }
)


def is_context_overflow(exc: UpstreamError) -> bool:
    """Whether an upstream error says the prompt does not fit the context."""
    return exc.kind == "http_4xx" and bool(_CONTEXT_OVERFLOW_RE.search(exc.message))


@dataclass
class Turn:
    """One turn under way (the rollout's lock is held for it)."""

    record: RolloutRecord
    body: dict[str, Any]
    messages: list[dict[str, Any]]
    upstream_body: dict[str, Any]
    engine: EngineInfo
    policy_version: int | None
    policy_epoch: int
    started_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)

    @property
    def agent_streams(self) -> bool:
        """Whether the agent asked for a stream."""
        return bool(self.body.get("stream"))

    @property
    def agent_wants_usage(self) -> bool:
        """Whether the agent's stream should end with a usage chunk."""
        options = self.body.get("stream_options")
        return isinstance(options, Mapping) and bool(options.get("include_usage"))


def prepare_upstream_body(
    request: dict[str, Any], record: RolloutRecord, engine: EngineInfo
) -> dict[str, Any]:
    """Finish the upstream request built from the agent's body (in place, returned).

    Adds the engine's token-id flags, asks for reasoning whatever the agent asked (vLLM
    drops token ids and logprobs when ``include_reasoning`` is false), replaces a
    registered ``seed`` by the turn's own derived seed, and streams from engines that
    stream token ids when the agent streams.
    """
    request.update(token_flags(engine.kind))
    if engine.kind != "sglang":
        request["include_reasoning"] = True
    registered = flatten_sampling_params(record.sampling_params)
    seed = registered.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        request["seed"] = turn_seed(seed, record.num_turns)
    return request


def _sampling_sent(upstream_body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in upstream_body.items() if k not in _NOT_SAMPLING}


def agent_answer(completion: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """The whole answer as the agent asked for it (ids, logprobs, reasoning)."""
    answer = agent_view(completion, body)
    if body.get("include_reasoning") is False:
        choices = []
        for choice in answer.get("choices") or []:
            if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
                message = {
                    k: v
                    for k, v in choice["message"].items()
                    if k not in ("reasoning", "reasoning_content")
                }
                choice = {**choice, "message": message}
            choices.append(choice)
        answer = {**answer, "choices": choices}
    return answer


#: The task running one turn: (the whole answer, whether its chunks were relayed).
_TurnTask = asyncio.Task[tuple[dict[str, Any], bool]]


def _abandon(task: _TurnTask, getter: asyncio.Task[bytes]) -> None:
    """The agent's stream is over: stop waiting, and abort the turn if still running
    (closing the upstream stream makes the engine abort the generation; the turn task
    then releases the rollout's lock)."""
    getter.cancel()
    if not task.done() and not task.cancelling():  # a second cancel would also cut
        task.cancel()  # the task's own clean-up (closing the upstream stream)


class _TurnStreamResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends.

    Starlette stops iterating the body when the client disconnects, but does not close
    the generator (its ``finally`` would only run at garbage collection).
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class TurnRunner:
    """Runs turns against the upstreams and records them.

    Args:
        pool: the upstream connection pools.
        registry: the rollouts (touched on activity).
        metrics: counters of turns and upstream errors.
        policy: the policy version in effect.
        keepalive_s: silence after which a streaming agent gets a keepalive comment.
    """

    def __init__(
        self,
        pool: UpstreamPool,
        registry: RolloutRegistry,
        metrics: GatewayMetrics,
        policy: PolicyClock,
        *,
        keepalive_s: float = 10.0,
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.metrics = metrics
        self.policy = policy
        self.keepalive_s = keepalive_s

    # -- entry point ---------------------------------------------------------------------

    async def respond(self, turn: Turn) -> Response:
        """Run ``turn`` and answer the agent. The caller holds ``turn.record.lock``;
        from here the runner releases it."""
        if not turn.agent_streams:
            completion, _ = await self._owned(turn, None)
            return JSONResponse(agent_answer(completion, turn.body))
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        task: _TurnTask = asyncio.create_task(self._owned(turn, queue.put_nowait))
        getter: asyncio.Task[bytes] = asyncio.create_task(queue.get())
        done, _ = await asyncio.wait(
            {task, getter}, timeout=self.keepalive_s, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done and getter not in done and task.exception() is not None:
            getter.cancel()
            raise task.exception()  # type: ignore[misc]  # status code still ours to set
        return _TurnStreamResponse(
            self._agent_stream(turn, task, queue, getter),
            on_close=lambda: _abandon(task, getter),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _agent_stream(
        self,
        turn: Turn,
        task: _TurnTask,
        queue: asyncio.Queue[bytes],
        getter: asyncio.Task[bytes],
    ) -> AsyncIterator[bytes]:
        try:
            while True:
                if getter.done():
                    yield getter.result()
                    getter = asyncio.create_task(queue.get())
                    continue
                if task.done():
                    getter.cancel()
                    while not queue.empty():
                        yield queue.get_nowait()
                    async for event in self._stream_end(turn, task):
                        yield event
                    return
                done, _ = await asyncio.wait(
                    {task, getter}, timeout=self.keepalive_s, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    yield KEEPALIVE_EVENT
        finally:
            _abandon(task, getter)

    async def _stream_end(self, turn: Turn, task: _TurnTask) -> AsyncIterator[bytes]:
        exc = task.exception()
        if isinstance(exc, ApiError):
            yield sse_error_event(exc.message, exc.status_code, exc.error_type)
            yield DONE_EVENT
            return
        if exc is not None:
            yield sse_error_event(f"internal gateway error: {exc!r}", 500, "internal_error")
            yield DONE_EVENT
            return
        completion, streamed = task.result()
        if streamed:  # the chunks went out as the engine sent them
            yield DONE_EVENT
            return
        answer = agent_answer(completion, turn.body)
        for event in iter_completion_sse(answer, include_usage=turn.agent_wants_usage):
            yield event

    # -- the turn ------------------------------------------------------------------------

    async def _owned(
        self, turn: Turn, emit: Callable[[bytes], None] | None
    ) -> tuple[dict[str, Any], bool]:
        try:
            return await self._execute(turn, emit)
        finally:
            turn.record.lock.release()

    async def _execute(
        self, turn: Turn, emit: Callable[[bytes], None] | None
    ) -> tuple[dict[str, Any], bool]:
        """Call the engine (streaming when ``emit`` is given and the engine streams ids),
        record the turn; returns (the whole answer, whether it was relayed by ``emit``)."""
        record = turn.record
        streamed = emit is not None and turn.engine.streams_token_ids
        first_token_s: float | None = None
        try:
            if streamed:
                turn.upstream_body["stream"] = True
                turn.upstream_body["stream_options"] = {"include_usage": True}
                completion, first_token_s = await self._stream_upstream(turn, emit)  # type: ignore[arg-type]
            else:
                completion, _ = await self.pool.chat(record.upstream, turn.upstream_body)
        except UpstreamError as exc:
            self._upstream_failed(turn, exc)
            raise AssertionError("unreachable") from None
        upstream_s = time.perf_counter() - turn.started
        answer = read_answer(completion)
        self._record(turn, answer, first_token_s, upstream_s)
        self.metrics.turns.inc(record.upstream)
        self.metrics.upstream_latency.observe(upstream_s, record.upstream)
        first = answer.first
        logger.info(
            "rollout=%s turn=%d upstream_ms=%.1f streamed=%s finish=%s",
            record.rollout_id,
            record.num_turns,
            upstream_s * 1000,
            streamed,
            first.finish_reason if first else None,
        )
        return completion, streamed

    async def _stream_upstream(
        self, turn: Turn, emit: Callable[[bytes], None]
    ) -> tuple[dict[str, Any], float | None]:
        """Stream from the engine, relaying chunks; returns (whole answer, first-chunk s)."""
        upstream = self.pool.get(turn.record.upstream)
        url = upstream.base_url
        assembler = StreamAssembler()
        first_token_s: float | None = None
        upstream.in_flight += 1
        try:
            client = upstream.client
            request = client.build_request("POST", "/chat/completions", json=turn.upstream_body)
            response = await client.send(request, stream=True)
            try:
                if response.status_code >= 400:
                    await response.aread()
                    raise_for_upstream_status(response)
                upstream.healthy = True
                async for chunk in iter_sse_json(response.aiter_lines()):
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - turn.started
                    assembler.feed(chunk)
                    out = agent_chunk(chunk, turn.body, include_usage=turn.agent_wants_usage)
                    if out is not None:
                        emit(sse_event(out))
            finally:
                # Shielded: closing the stream is what tells the engine to stop generating.
                await asyncio.shield(response.aclose())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            upstream.healthy = False
            raise UpstreamError("connect", 502, f"upstream {url} unreachable: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise UpstreamError("timeout", 502, f"upstream {url} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError("transport", 502, f"upstream {url} failed: {exc!r}") from exc
        except StreamError as exc:
            raise UpstreamError("protocol", exc.status_code, exc.message) from exc
        finally:
            upstream.in_flight -= 1
        if not assembler.finished:
            raise UpstreamError("protocol", 502, "upstream stream ended before the answer did")
        return assembler.completion(), first_token_s

    def _upstream_failed(self, turn: Turn, exc: UpstreamError) -> None:
        """Count, log and (for a context overflow) record a failed turn; raise ApiError."""
        record = turn.record
        self.metrics.upstream_errors.inc(record.upstream, exc.kind)
        self.registry.touch(record)
        logger.warning(
            "rollout=%s turn=%d upstream=%s error=%s: %s",
            record.rollout_id,
            record.num_turns + 1,
            record.upstream,
            exc.kind,
            exc.message,
        )
        if not is_context_overflow(exc):
            raise ApiError(exc.status_code, exc.message, "upstream_error") from None
        message = (
            f"context length exceeded: {exc.message} The rollout is over: this turn is "
            "recorded as truncated and later turns are refused."
        )
        error: TurnError = {
            "type": "context_length_exceeded",
            "message": exc.message,
            "status_code": 400,
        }
        extras: StepExtras = {
            "status": "error",
            "error": error,
            "timing": {
                "started_at": turn.started_at,
                "first_token_s": None,
                "upstream_s": time.perf_counter() - turn.started,
            },
            "sampling": _sampling_sent(turn.upstream_body),
            "policy_version": turn.policy_version,
        }
        record.recorder.record_refused(turn.messages, extras)
        record.truncated_reason = "context_length_exceeded"
        if record.status == "active":
            record.status = "completed"
        raise ApiError(400, message, "context_length_exceeded") from None

    def _record(
        self,
        turn: Turn,
        answer: EngineAnswer,
        first_token_s: float | None,
        upstream_s: float,
    ) -> None:
        record = turn.record
        engine = turn.engine
        first = answer.first
        extras: StepExtras = {
            "status": "ok",
            "finish_reason": first.finish_reason if first else None,
            "stop_reason": first.stop_reason if first else None,
            "usage": answer.usage,
            "cached_tokens": answer.cached_tokens,
            "timing": {
                "started_at": turn.started_at,
                "first_token_s": first_token_s,
                "upstream_s": upstream_s,
            },
            "sampling": _sampling_sent(turn.upstream_body),
            "policy_version": (
                turn.policy_version
                if turn.policy_version is not None
                else self.policy.stamp(answer.weight_version)
            ),
        }
        if self.policy.epoch != turn.policy_epoch:
            extras["policy_version_end"] = self.policy.version
        if answer.weight_version is not None:
            extras["engine_weight_version"] = answer.weight_version
        if first is not None and first.sentinels:
            extras["logprob_sentinels"] = first.sentinels
        if len(answer.choices) > 1:
            extras["other_choices"] = [
                {
                    "index": c.index,
                    "completion": [c.message],
                    "completion_ids": c.completion_ids,
                    "completion_logprobs": c.completion_logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in answer.choices[1:]
            ]
        if not answer.has_token_ids:
            extras["tokens_missing"] = "the upstream's answer carries no token ids"
            if engine.token_ids is not False:
                logger.error(
                    "upstream=%s answers carry NO token ids (engine=%s): rollout=%s turn=%d is "
                    "recorded with tokens null; the trainer cannot use it. Run vLLM >= 0.10.2 "
                    "or an SGLang with return_prompt_token_ids / return_token_ids.",
                    record.upstream,
                    engine.kind,
                    record.rollout_id,
                    record.num_turns + 1,
                )
            engine.token_ids = False
        else:
            engine.token_ids = True
        usage = answer.usage or {}
        total = usage.get("total_tokens")
        record.recorder.record(
            turn.messages,
            [first.message] if first else [],
            prompt_ids=answer.prompt_ids,
            completion_ids=first.completion_ids if first else None,
            completion_logprobs=first.completion_logprobs if first else None,
            finish_reason=first.finish_reason if first else None,
            total_tokens=total if isinstance(total, int) else None,
            extras=extras,
        )
        record.num_turns += 1
        if record.at_max_turns and record.status == "active":
            record.status = "completed"
        self.registry.touch(record)


__all__ = [
    "Turn",
    "TurnRunner",
    "agent_answer",
    "is_context_overflow",
    "prepare_upstream_body",
]
