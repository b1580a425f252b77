"""The engine side of one turn: the call (streamed from vLLM or whole), and the step.

:class:`EngineTurn` finishes the upstream request (the engine's token-id flags, the turn's
own seed, reasoning always asked for), calls the engine and records the step with the
turn's facts in its ``extras`` (:class:`~rollout_gateway.protocol.StepExtras`): status,
finish and stop reasons, usage, cached tokens, timing, the sampling actually sent, the
policy version, sentinel logprobs, the other choices of an ``n > 1`` answer, and why the
tokens are missing when they are.

Token-in mode (:mod:`.token_in`): the gateway renders or bridges the prompt ids itself
and calls vLLM's ``/inference/v1/generate`` whole; the answer is shaped as a vLLM chat
completion and recorded the same way.

Streaming: when the agent streams and the engine streams token ids (vLLM), the engine is
streamed from; each chunk, trimmed to what the agent asked for, is handed to ``emit``
as it arrives while :class:`~rollout_gateway.server.engines.streaming.StreamAssembler` rebuilds
the whole answer for the recorder. SGLang refuses its token-id flags on streamed
requests, so other engines are called whole (the agent's stream is synthesized after).

A prompt the engine refuses as longer than its context is recorded as a step (its
prompt, no completion, ``status: "error"``), the rollout ends truncated with
``truncation_reason: "context_length_exceeded"``, and the agent is told so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rollout_gateway.protocol import FailedTurn, StepExtras, TurnError
from rollout_gateway.server.agents.limits import NO_RETRY_HEADERS
from rollout_gateway.server.engines.answers import (
    ChoiceSample,
    EngineAnswer,
    MalformedAnswer,
    read_answer,
)
from rollout_gateway.server.engines.context_refusal import (
    COMPLETION,
    PROMPT,
    read_context_refusal,
    retry_max_tokens,
)
from rollout_gateway.server.engines.probe import TOKEN_FLAG_FIELDS, EngineInfo, token_flags
from rollout_gateway.server.engines.streaming import (
    StreamAssembler,
    StreamError,
    agent_chunk,
    iter_sse_json,
    sse_event,
)
from rollout_gateway.server.engines.upstream import (
    UpstreamError,
    UpstreamPool,
    malformed_answer,
    parse_completion,
    raise_for_upstream_status,
)
from rollout_gateway.server.engines.upstream_request import agent_view
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.responses import ApiError
from rollout_gateway.server.recording.history import HistoryMatch
from rollout_gateway.server.recording.prompt_ids import IdsText, split_prompt_ids
from rollout_gateway.server.turn_seed import turn_seed

if TYPE_CHECKING:
    from rollout_gateway.server.dialects.base import StreamRenderer
    from rollout_gateway.server.state.policy import PolicyClock
    from rollout_gateway.server.state.registry import RolloutRecord

logger = logging.getLogger("rollout_gateway.server")


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
        *TOKEN_FLAG_FIELDS,
    }
)


def is_context_overflow(exc: UpstreamError) -> bool:
    """Whether an upstream error says the prompt itself does not fit the engine's context
    (not a ``max_tokens`` too large for the room the prompt leaves:
    :mod:`.context_refusal`)."""
    if exc.kind != "http_4xx":
        return False
    refusal = read_context_refusal(exc.message)
    return refusal is not None and refusal.kind == PROMPT


def prepare_upstream_body(
    request: dict[str, Any], record: RolloutRecord, engine: EngineInfo
) -> dict[str, Any]:
    """Finish the upstream request (in place; returned).

    Adds the engine's token-id flags; asks for reasoning whatever the agent asked (vLLM
    withholds token ids and logprobs when ``include_reasoning`` is false); replaces a
    registered ``seed`` by the turn's own derived seed (:func:`turn_seed`).
    """
    request.update(token_flags(engine.kind))
    if engine.kind != "sglang":
        request["include_reasoning"] = True
    seed = record.flat_sampling.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        request["seed"] = turn_seed(seed, record.num_turns)
    return request


def agent_answer(completion: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """The whole answer as the agent asked for it: ids and logprobs only when asked,
    reasoning dropped when it sent ``include_reasoning: false``."""
    answer = agent_view(completion, body)
    if body.get("include_reasoning") is not False:
        return answer
    hidden = ("reasoning", "reasoning_content")
    choices = []
    for choice in answer.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
            message = {k: v for k, v in choice["message"].items() if k not in hidden}
            choice = {**choice, "message": message}
        choices.append(choice)
    return {**answer, "choices": choices}


def wants_usage(body: Mapping[str, Any]) -> bool:
    """Whether the agent's stream should carry usage (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))


@dataclass
class EngineResult:
    """The engine's answer to a turn."""

    #: The whole answer (reassembled from the chunks when streamed; its top-level
    #: ``prompt_token_ids`` cut out, see ``prompt_ids_json``, when not).
    completion: dict[str, Any]
    #: The engine's bytes as they came (not streamed), passed through when they are
    #: exactly what the agent asked for.
    raw: bytes | None = None
    #: Whether ``raw`` is strict JSON (no ``NaN``/``Infinity``).
    strict: bool = True
    #: The JSON text of the prompt's id array, cut out of ``raw``.
    prompt_ids_json: IdsText | None = None
    #: ``raw`` with that array replaced by ``null`` (what a store keeps of the answer).
    raw_without_prompt_ids: bytes | None = None
    #: Whether the chunks were relayed to the agent as the engine sent them.
    relayed: bool = False


class TokenInCall(Protocol):
    """Token-in mode's engine (:class:`~.token_in.TokenInEngine`) as a turn calls it."""

    async def complete(self, turn: EngineTurn) -> dict[str, Any]:
        """The turn's answer, rendered and generated by the gateway itself."""
        ...


@dataclass
class EngineTurn:
    """One turn's engine call and its recording (the rollout's lock is held)."""

    #: The upstreams (the rollout's is ``record.upstream``).
    pool: UpstreamPool
    #: The policy version in effect, stamped on the step.
    policy: PolicyClock
    #: Token-in mode's engine (``None`` in chat mode: the upstream renders).
    token_in: TokenInCall | None
    record: RolloutRecord
    body: dict[str, Any]
    messages: list[Any]
    upstream_body: dict[str, Any]
    engine: EngineInfo
    #: How the request extends the rollout's recorded history (``None``: not checked).
    history: HistoryMatch | None = None
    #: Facts known before the call (e.g. the agent fields the allowlist dropped).
    extras: dict[str, Any] = field(default_factory=dict)
    #: The agent's dialect's stream renderer (``None``: chat, whose chunks are the
    #: engine's own, trimmed): each engine chunk goes to the agent as its events.
    renderer: StreamRenderer | None = None
    #: The engine's assistant message as the agent's dialect will echo it (what the step
    #: records as the completion; ``None``: the message itself).
    recorded_answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    started_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.policy_version = self.policy.version
        self.policy_epoch = self.policy.epoch
        #: The turn's own number in its rollout (1 for the first), for the logs.
        self.number = self.record.num_turns + 1
        #: The recorded sample's completion ids and finish reason, once the answer is in.
        self.completion_ids: list[int] | None = None
        self.finish_reason: str | None = None
        #: Token-in mode: the turn's MoE routing (see :mod:`.routed_experts`), if sent.
        self.routed_experts: dict[str, Any] | None = None
        #: Whether the engine refused the prompt as longer than its context (recorded
        #: as the rollout's truncation).
        self.overflowed = False
        #: The failed call, once the engine call failed (not a context overflow): what
        #: the rollout keeps in its ``failed_turns``.
        self.failed_turn: FailedTurn | None = None

    async def call(self, emit: Callable[[bytes], None] | None) -> EngineResult:
        """Call the engine and record the step.

        Streams when ``emit`` is given and the engine streams token ids. A ``max_tokens``
        the engine refuses as larger than the room its prompt leaves is lowered to that
        room and asked again, once (:meth:`_lower_max_tokens`). Raises
        :class:`UpstreamError` (after recording a context overflow, or keeping the
        failed call in ``failed_turns``).
        """
        try:
            try:
                result, answer, first_chunk_s = await self._attempt(emit)
            except UpstreamError as exc:
                if not self._lower_max_tokens(exc):
                    raise
                result, answer, first_chunk_s = await self._attempt(emit)
        except MalformedAnswer as exc:
            failure = malformed_answer(str(exc))
            self._note_failure(failure)
            raise failure from None
        except UpstreamError as exc:
            if is_context_overflow(exc):
                self._record_overflow(exc)
            else:
                self._note_failure(exc)
            raise
        self._record(answer, first_chunk_s, result.prompt_ids_json)
        return result

    async def _attempt(
        self, emit: Callable[[bytes], None] | None
    ) -> tuple[EngineResult, EngineAnswer, float | None]:
        """One call of the engine: its answer, read (raises :class:`MalformedAnswer`
        for one that is not a chat completion: the upstream's fault, a 502)."""
        token_in = self.token_in
        streamed = emit is not None and self.engine.streams_token_ids and token_in is None
        first_chunk_s: float | None = None
        if token_in is not None:  # the gateway renders; the agent's stream is synthesized
            result = EngineResult(await token_in.complete(self))
        elif streamed:
            completion, first_chunk_s = await self._stream(emit)  # type: ignore[arg-type]
            result = EngineResult(completion, relayed=True)
        else:
            raw, _ = await self.pool.chat_raw(self.record.upstream, self.upstream_body)
            # The prompt's ids stay JSON text: the recorder parses only what is new.
            rest, prompt_ids_json = split_prompt_ids(raw)
            completion, strict = parse_completion(rest)
            without = rest if prompt_ids_json is not None else None
            result = EngineResult(completion, raw, strict, prompt_ids_json, without)
        return result, read_answer(result.completion), first_chunk_s

    def _lower_max_tokens(self, exc: UpstreamError) -> bool:
        """After the engine refused the ``max_tokens`` sent as more than its context leaves
        after the prompt: lower it to the room the engine states, for one more call.
        Returns whether there is one (token-in mode renders the prompt itself and sends
        what fits; a refusal that states no smaller room goes to the agent).

        A refusal that states the engine's context teaches it to the gateway when its
        model card did not (the next turns are bounded by it).
        """
        sent = self.upstream_body.get("max_tokens")
        if exc.kind != "http_4xx" or self.token_in is not None or not isinstance(sent, int):
            return False
        refusal = read_context_refusal(exc.message)
        if refusal is None or refusal.kind != COMPLETION:
            return False
        if refusal.window is not None and self.engine.max_model_len is None:
            self.engine.max_model_len = refusal.window
        lowered = retry_max_tokens(refusal, sent=sent)
        if lowered is None:
            return False
        self.upstream_body["max_tokens"] = lowered
        self.extras["max_tokens_refused"] = {"max_tokens": sent, "message": exc.message[:500]}
        logger.info(
            "rollout=%s turn=%d: the engine refused max_tokens=%d (more than its context "
            "leaves); asking again with %d",
            self.record.rollout_id, self.number, sent, lowered,
        )  # fmt: skip
        return True

    @property
    def shared(self) -> int | None:
        """Leading messages shared with the previous turn (``None``: history rewritten,
        or not checked)."""
        return self.history.shared if self.history is not None else None

    def upstream_seconds(self) -> float:
        """Seconds since the turn went upstream."""
        return time.perf_counter() - self.started

    async def _stream(self, emit: Callable[[bytes], None]) -> tuple[dict[str, Any], float | None]:
        pool = self.pool
        upstream = pool.get(self.record.upstream)
        label = upstream.label
        body = {**self.upstream_body, "stream": True, "stream_options": {"include_usage": True}}
        self.upstream_body = body
        include_usage = wants_usage(self.body)
        assembler = StreamAssembler()
        renderer = self.renderer
        first_chunk_s: float | None = None
        stream = upstream.http.stream("/chat/completions", jsonio.dumps_request_pieces(body))
        try:
            with upstream.call:  # counted in flight, a failure to get the answer classified
                async with asyncio.timeout(pool.timeout_s), stream as response:
                    upstream.answered()
                    if response.status_code >= 400:
                        raise_for_upstream_status(await response.read(), label)
                    async for chunk in iter_sse_json(response.chunks()):
                        if first_chunk_s is None:
                            first_chunk_s = self.upstream_seconds()
                        assembler.feed(chunk)
                        if renderer is not None:  # the agent's dialect's events
                            events = renderer.feed(chunk)
                            if events:
                                emit(events)
                            continue
                        out = agent_chunk(chunk, self.body, include_usage=include_usage)
                        if out is not None:
                            emit(sse_event(out))
        except StreamError as exc:
            detail = f"{label}: {exc.detail}"
            raise UpstreamError("protocol", exc.status_code, exc.message, detail) from exc
        if not assembler.finished:
            raise UpstreamError("protocol", 502, "upstream stream ended before its answer did")
        return assembler.completion(), first_chunk_s

    def _base_extras(self, first_chunk_s: float | None) -> StepExtras:
        extras: StepExtras = {
            "timing": {
                "started_at": self.started_at,
                "first_token_s": first_chunk_s,
                "upstream_s": self.upstream_seconds(),
            },
            "sampling": {k: v for k, v in self.upstream_body.items() if k not in _NOT_SAMPLING},
            "policy_version": self.policy_version,
        }
        if self.policy.epoch != self.policy_epoch:  # weights changed mid-turn
            extras["policy_version_end"] = self.policy.version
        return extras

    def _note_failure(self, exc: UpstreamError) -> None:
        """Describe a failed call (:attr:`failed_turn`: the rollout's owner keeps it)."""
        error: TurnError = {
            "type": exc.kind,
            "message": exc.message,
            "status_code": exc.status_code,
        }
        if exc.upstream_status is not None:
            error["upstream_status"] = exc.upstream_status
        failed: FailedTurn = {
            "after_steps": self.record.recorder.num_steps,
            "error": error,
            "timing": self._base_extras(None)["timing"],
        }
        self.failed_turn = failed

    def _record_overflow(self, exc: UpstreamError) -> None:
        record = self.record
        error: TurnError = {
            "type": "context_length_exceeded",
            "message": exc.message,
            "status_code": 400,
        }
        extras = self._base_extras(None)
        extras.update({"status": "error", "error": error})
        # The step (no sample); the rollout's owner ends the rollout (record_overflow).
        record.recorder.record_refused(self.messages, {**self.extras, **extras})
        self.overflowed = True
        logger.warning(
            "rollout=%s turn=%d: prompt longer than the engine's context; recorded, "
            "rollout truncated",
            record.rollout_id,
            self.number,
        )

    def _record(
        self, answer: EngineAnswer, first_chunk_s: float | None, prompt_ids_json: IdsText | None
    ) -> None:
        record, engine, first = self.record, self.engine, answer.first
        if prompt_ids_json is None:  # a streamed answer's ids stay text too (.streaming)
            prompt_ids_json = answer.prompt_ids_json
        self.finish_reason = first.finish_reason if first else None
        extras: dict[str, Any] = {**self.extras, **self._base_extras(first_chunk_s)}
        extras.update(
            status="ok",
            finish_reason=first.finish_reason if first else None,
            stop_reason=first.stop_reason if first else None,
            usage=answer.usage,
            cached_tokens=answer.cached_tokens,
            tools=self.upstream_body.get("tools") or [],
        )
        if extras["policy_version"] is None:
            extras["policy_version"] = self.policy.stamp(answer.weight_version)
        if answer.weight_version is not None:
            extras["engine_weight_version"] = answer.weight_version
        if first is not None and first.sentinels:
            extras["logprob_sentinels"] = first.sentinels
        if len(answer.choices) > 1:  # n > 1 (registered): no sampled token is dropped
            extras["other_choices"] = [_other_choice(c) for c in answer.choices[1:]]
        has_prompt = answer.prompt_ids is not None or prompt_ids_json is not None
        if not (has_prompt and first is not None and first.completion_ids is not None):
            extras["tokens_missing"] = "the upstream's answer carries no token ids"
            self._no_token_ids()
        else:
            engine.token_ids = True
        usage = answer.usage or {}
        total = usage.get("total_tokens")
        self.completion_ids = first.completion_ids if first else None
        completion: list[dict[str, Any]] = []
        if first is not None:
            recorded = self.recorded_answer
            completion.append(recorded(first.message) if recorded else first.message)
        record.recorder.record(
            self.messages,
            completion,
            prompt_ids=answer.prompt_ids,
            completion_ids=first.completion_ids if first else None,
            completion_logprobs=first.completion_logprobs if first else None,
            finish_reason=first.finish_reason if first else None,
            total_tokens=total if isinstance(total, int) else None,
            history=self.history,
            extras=extras,
            prompt_ids_json=prompt_ids_json,
            routed_experts=self.routed_experts,
        )

    def _no_token_ids(self) -> None:
        """Say once per engine, loudly, that its answers carry no token ids."""
        engine = self.engine
        if engine.token_ids is not False:
            logger.error(
                "upstream=%s answers carry NO token ids (engine=%s): rollout=%s turn=%d is "
                "recorded with tokens null and cannot be trained on. Run vLLM >= 0.10.2, "
                "or an SGLang with return_prompt_token_ids / return_token_ids.",
                self.pool.get(self.record.upstream).label,
                engine.kind,
                self.record.rollout_id,
                self.number,
            )
        engine.token_ids = False


def _other_choice(choice: ChoiceSample) -> dict[str, Any]:
    """A choice beyond the first (``n`` > 1), as the step's ``extras.other_choices`` keeps it."""
    return {
        "index": choice.index,
        "completion": [choice.message],
        "completion_ids": choice.completion_ids,
        "completion_logprobs": choice.completion_logprobs,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
    }


def context_overflow_error(exc: UpstreamError) -> ApiError:
    """What the agent is told when its prompt does not fit: the rollout is over (final:
    ``x-should-retry: false``, which both official SDKs obey, as on every refusal)."""
    return ApiError(
        400,
        f"context length exceeded: {exc.message} This rollout is over: the turn is recorded "
        "as truncated and later turns are refused.",
        "invalid_request_error",
        code="context_length_exceeded",
        headers=NO_RETRY_HEADERS,
    )


__all__ = [
    "EngineResult",
    "EngineTurn",
    "agent_answer",
    "context_overflow_error",
    "is_context_overflow",
    "prepare_upstream_body",
    "wants_usage",
]
