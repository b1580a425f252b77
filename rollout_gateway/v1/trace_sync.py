"""Rebuild a verifiers v1 ``Trace`` from the turns the rollout gateway recorded.

v1's own interception server commits every model call into the trace's message graph
as it happens. In gateway mode the calls never cross the env process, so the adapter
replays the gateway's recorded turns through the same public graph API afterwards:
``graph.prepare_turn`` on the request's messages and tools, ``PendingTurn.commit`` with a
``Response`` carrying the gateway's ``TurnTokens``, then one ``ModelCall`` per turn. When
each turn's prompt ids extend the previous prompt + completion (the gateway's upstream
renders the same history the same way), the graph keeps one branch, which prime-rl's
sample builder takes as one training sample.

:class:`TraceSync` is incremental: it remembers how many steps it committed, so syncing
again after more turns (multi-segment interactions, the final sync at slot release)
commits only the new ones.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from verifiers.v1 import graph
from verifiers.v1.dialects.chat import ChatDialect, parse_message
from verifiers.v1.trace import Error, ModelCall, TimeSpan, Trace
from verifiers.v1.types import (
    AssistantMessage,
    FinishReason,
    Response,
    Sampling,
    TurnTokens,
    Usage,
)

#: v1 normalizes finish reasons to these; anything else is recorded as ``None``.
FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})

_CHAT = ChatDialect()


class TraceSyncError(ValueError):
    """A recorded turn cannot be placed into the trace (malformed messages)."""


def _finish_reason(step: Mapping[str, Any], message: AssistantMessage) -> FinishReason:
    reason = step.get("finish_reason")
    if reason is None:
        reason = (step.get("extras") or {}).get("finish_reason")
    if reason in FINISH_REASONS:
        return cast(FinishReason, reason)
    if reason is not None:
        return None
    # Gateways that do not report it: derive it the way the upstream would have.
    if step.get("is_truncated"):
        return "length"
    return "tool_calls" if message.tool_calls else "stop"


def _usage(step: Mapping[str, Any], tokens: Mapping[str, Any] | None) -> Usage | None:
    """Usage as v1 counts it (``prompt_tokens`` without cache reads).

    Prefer the usage the gateway recorded; else count the recorded token ids, which is
    what the upstream billed for this turn.
    """
    usage = step.get("usage")
    if usage is None:
        usage = (step.get("extras") or {}).get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details") or {}
        cached = (step.get("extras") or {}).get("cached_tokens")
        if cached is None:
            cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        cached = cached if isinstance(cached, int) else None
        return Usage(
            prompt_tokens=int(usage["prompt_tokens"]) - (cached or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_input_tokens=cached,
        )
    if tokens is not None:
        return Usage(
            prompt_tokens=len(tokens.get("prompt_ids") or ()),
            completion_tokens=len(tokens.get("completion_ids") or ()),
        )
    return None


def _span(step: Mapping[str, Any]) -> TimeSpan:
    timing = step.get("timing")
    if timing is None:
        timing = (step.get("extras") or {}).get("timing")
    if isinstance(timing, Mapping):
        # The reference gateway: when the turn went upstream, and how long it took.
        start, took = timing.get("started_at"), timing.get("upstream_s")
        if isinstance(start, int | float) and isinstance(took, int | float):
            return TimeSpan(start=float(start), end=float(start) + float(took))
    return TimeSpan()


def _sampling(step: Mapping[str, Any], registered: Sampling | None) -> Sampling | None:
    """The sampling actually sent upstream for this turn, else the registered one."""
    sent = (step.get("extras") or {}).get("sampling")
    if isinstance(sent, Mapping):
        try:
            return _CHAT.parse_sampling(dict(sent))
        except ValueError:
            return registered
    return registered


def _step_error(step: Mapping[str, Any]) -> Error | None:
    extras = step.get("extras") or {}
    error = step.get("error")
    if error is None:
        error = extras.get("error")
    if error is None and extras.get("status") == "error":
        error = {"type": "GatewayTurnError", "message": "the gateway recorded a failed turn"}
    if not error:
        return None
    if isinstance(error, Mapping):
        return Error(
            type=str(error.get("type") or "GatewayTurnError"),
            message=str(error.get("message") or ""),
            status_code=error.get("status_code")
            if isinstance(error.get("status_code"), int)
            else None,
        )
    return Error(type="GatewayTurnError", message=str(error))


def _assistant(completion: Sequence[Mapping[str, Any]]) -> AssistantMessage:
    for raw in completion:
        if raw.get("role") == "assistant":
            message = parse_message(dict(raw))
            assert isinstance(message, AssistantMessage)
            return message
    raise TraceSyncError("recorded turn has no assistant message in its completion")


def _turn_tokens(tokens: Mapping[str, Any] | None) -> TurnTokens | None:
    if not tokens:
        return None
    return TurnTokens(
        prompt_ids=list(tokens.get("prompt_ids") or ()),
        completion_ids=list(tokens.get("completion_ids") or ()),
        completion_logprobs=list(tokens.get("completion_logprobs") or ()),
    )


class TraceSync:
    """Commits a rollout's recorded gateway turns into its v1 trace, each turn once.

    Args:
        trace: the rollout's live trace.
        model: the registered model (recorded on every ``ModelCall``).
        sampling: the registered sampling (what the gateway sent; the agent's own
            sampling fields do not override it).
        rollout_id: the gateway rollout id (response ids are derived from it).
    """

    def __init__(
        self, trace: Trace, *, model: str, sampling: Sampling | None, rollout_id: str
    ) -> None:
        self.trace = trace
        self.model = model
        self.sampling = sampling
        self.rollout_id = rollout_id
        #: Recorded steps already committed (or recorded as failed calls).
        self.committed = 0

    def apply(self, steps: Sequence[Mapping[str, Any]]) -> int:
        """Commit the steps not committed yet; returns how many were new."""
        new = steps[self.committed :]
        for offset, step in enumerate(new):
            self._commit_step(self.committed + offset, step)
        self.committed = len(steps)
        if new:
            self.trace.notify()
        return len(new)

    def _commit_step(self, index: int, step: Mapping[str, Any]) -> None:
        request = {"messages": list(step.get("prompt") or ())}
        tools = step.get("tools")
        if tools is None:
            tools = (step.get("extras") or {}).get("tools")
        if tools:
            request["tools"] = list(tools)
        try:
            parsed = _CHAT.parse_request(request)
        except ValueError as e:
            raise TraceSyncError(f"turn {index + 1}: unparseable request: {e}") from e
        span = _span(step)
        error = _step_error(step)
        sampling = _sampling(step, self.sampling)
        completion = step.get("completion") or ()
        if error is not None or not completion:
            # A failed exchange commits no node; v1 records the call with its error.
            self.trace.calls.append(
                ModelCall(
                    node=None,
                    model=self.model,
                    sampling=sampling,
                    endpoint=_CHAT.upstream_path,
                    time=span,
                    error=error or Error(type="GatewayTurnError", message="empty completion"),
                )
            )
            return
        message = _assistant(completion)
        tokens = step.get("tokens")
        finish = _finish_reason(step, message)
        usage = _usage(step, tokens)
        response = Response(
            id=f"{self.rollout_id}-turn-{index + 1}",
            created=int(span.end or time.time()),
            model=self.model,
            message=message,
            finish_reason=finish,
            usage=usage,
            tokens=_turn_tokens(tokens),
        )
        turn = graph.prepare_turn(self.trace, parsed.messages, parsed.tools)
        node = turn.commit(response)
        self.trace.calls.append(
            ModelCall(
                node=node,
                model=self.model,
                sampling=sampling,
                endpoint=_CHAT.upstream_path,
                finish_reason=finish,
                usage=usage,
                time=span,
            )
        )


__all__ = ["FINISH_REASONS", "TraceSync", "TraceSyncError"]
