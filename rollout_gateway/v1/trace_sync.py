"""Rebuild a verifiers v1 ``Trace`` from the turns the rollout gateway recorded.

v1's own interception server commits every model call into the trace as it happens: a
``ModelCall`` per exchange (with its error when it failed), the turn's messages and
tokens into the message graph. In gateway mode the calls never cross the env process,
so the adapter replays what the gateway recorded, through the same graph API
(``PendingTurn.commit`` with a ``Response`` carrying ``TurnTokens``), in the order the
exchanges happened:

- a sampled turn -> its nodes and one ``ModelCall`` (finish reason, usage, sampling,
  the gateway's timing), its routed experts (token-in mode) on ``TurnTokens``;
- an engine call that failed (``failed_turns``: unreachable, 5xx, timeout...) -> one
  ``ModelCall`` with v1's ``ProviderError`` and the status v1's own client gives that
  failure (503 unreachable, 504 timeout, the engine's own status for an HTTP error);
- a prompt the engine refused as too long (a step with ``status: "error"``) -> one
  failed ``ModelCall`` (``ProviderError``, 400), as v1's client records a 400.

Times are the turns' own: ``ModelCall.time`` from the gateway's timing and the nodes a
turn creates stamped with the time its answer came back (v1 stamps nodes when a turn
commits, which for a live interception is that moment). ``graph.prepare_turn`` and
``commit`` take no timestamp (no hook in v1 for it), so the adapter sets
``MessageNode.timestamp`` on the nodes the commit created.

Cost: the replay runs in the env process, once per turn, so it is kept small. It reads
the trajectory in the gateway's delta form (each step holds what the previous one does
not), parses only a step's new messages, and when a step extends the previous step's
prompt + answer (the usual case) hands ``commit`` the previous path as the prompt's
prefix instead of re-hashing every message of the history with ``prepare_turn``;
anything else (a rewritten history, changed tools, the first step) goes through
``prepare_turn`` as v1's server does. Each turn's prompt ids extend the previous
prompt + completion when the upstream rendered the history the same way, and the graph
then keeps one branch: one training sample for prime-rl.

:class:`TraceSync` is incremental: syncing again after more turns (multi-segment
interactions, the final sync at slot release) commits only the new ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import orjson

from rollout_gateway import protocol
from rollout_gateway.v1.errors import provider_error
from rollout_gateway.v1.internals import (
    AnthropicDialect,
    AssistantMessage,
    ChatDialect,
    Error,
    ModelCall,
    PendingTurn,
    ProviderError,
    Response,
    ResponsesDialect,
    Sampling,
    TimeSpan,
    ToolMessage,
    Trace,
    TurnTokens,
    Usage,
    parse_message,
    prepare_turn,
)

logger = logging.getLogger(__name__)

#: v1 normalizes finish reasons to these; anything else is recorded as ``None``.
FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})

_CHAT = ChatDialect()
#: The key of ``trace.info`` holding what the gateway did beside v1's own records.
TRACE_INFO_KEY = "rollout_gateway"
#: ``ModelCall.endpoint`` of a turn by the dialect it came in (``extras.dialect``): the
#: provider path v1's own interception records for that dialect (its ``upstream_path``).
_ENDPOINTS = {
    "chat": ChatDialect.upstream_path,
    "anthropic": AnthropicDialect.upstream_path,
    "responses": ResponsesDialect.upstream_path,
}


class TraceSyncError(ValueError):
    """A recorded turn cannot be placed into the trace (malformed messages)."""


def _finish_reason(step: Mapping[str, Any], message: Any) -> Any:
    extras = step.get("extras") or {}
    reason = step.get("finish_reason", extras.get("finish_reason"))
    if reason in FINISH_REASONS:
        return reason
    if reason is not None:
        return None
    # Gateways that do not report it: derive it the way the upstream would have.
    if step.get("is_truncated"):
        return "length"
    return "tool_calls" if message.tool_calls else "stop"


def _usage(step: Mapping[str, Any], prompt_n: int | None, completion_n: int | None) -> Any:
    """Usage as v1 counts it (``prompt_tokens`` without cache reads): the gateway's
    recorded usage, else the recorded token ids (what the upstream billed)."""
    extras = step.get("extras") or {}
    usage = step.get("usage", extras.get("usage"))
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details") or {}
        cached = extras.get("cached_tokens")
        if cached is None and isinstance(details, Mapping):
            cached = details.get("cached_tokens")
        cached = cached if isinstance(cached, int) else None
        return Usage.model_construct(
            prompt_tokens=int(usage["prompt_tokens"]) - (cached or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_input_tokens=cached,
            reasoning_tokens=None,
            cost=None,
        )
    if prompt_n is not None and completion_n is not None:
        return Usage.model_construct(
            prompt_tokens=prompt_n,
            completion_tokens=completion_n,
            cached_input_tokens=None,
            reasoning_tokens=None,
            cost=None,
        )
    return None


def _span(timing: Any) -> Any:
    """The exchange's ``TimeSpan`` from the gateway's timing (when the turn went upstream,
    how long it took); an empty span when the gateway sent none."""
    if isinstance(timing, Mapping):
        start, took = timing.get("started_at"), timing.get("upstream_s")
        if isinstance(start, int | float) and isinstance(took, int | float):
            return TimeSpan(start=float(start), end=float(start) + float(took))
    return TimeSpan()


def _assistant(completion: Sequence[Mapping[str, Any]]) -> Any:
    for raw in completion:
        if raw.get("role") == "assistant":
            message = parse_message(dict(raw))
            assert isinstance(message, AssistantMessage)
            return message
    raise TraceSyncError("recorded turn has no assistant message in its completion")


def _step_failure(step: Mapping[str, Any]) -> Any:
    """v1's ``ProviderError`` for a recorded step that produced no sample (the status v1's
    client gives that failure), else ``None``."""
    extras = step.get("extras") or {}
    error = step.get("error", extras.get("error"))
    if error is None and extras.get("status") == "error":
        error = {"type": "protocol", "message": "the gateway recorded a failed turn"}
    if not error:
        return None
    if not isinstance(error, Mapping):
        error = {"type": "protocol", "message": str(error)}
    if error.get("type") == "context_length_exceeded":  # the engine's own 400, relayed
        error = {**error, "upstream_status": error.get("status_code") or 400}
    return provider_error(error)


def _error_record(failure: Exception) -> Any:
    """``failure`` as v1's ``record_call`` records it (no traceback for a provider error)."""
    return Error(
        type=type(failure).__name__,
        message=str(failure),
        status_code=getattr(failure, "status_code", None),
        traceback=None,
    )


def _turn_response(
    step: Mapping[str, Any],
    message: Any,
    tokens: Mapping[str, Any] | None,
    prompt_ids: list[int] | None,
    model: str,
    response_id: str,
    span: Any,
) -> Any:
    """A recorded turn's answer as v1's ``Response``: the message, finish reason, usage,
    and its ``TurnTokens`` when the gateway recorded token ids."""
    completion_ids = list(tokens.get("completion_ids") or ()) if tokens is not None else []
    counted = prompt_ids is not None
    usage = _usage(
        step,
        len(prompt_ids) if prompt_ids is not None else None,
        len(completion_ids) if counted else None,
    )
    turn_tokens = None
    if prompt_ids is not None and tokens is not None:
        # Checked by the gateway: shared, not revalidated (long contexts' ids).
        turn_tokens = TurnTokens.model_construct(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            completion_logprobs=list(tokens.get("completion_logprobs") or ()),
            routed_experts=tokens.get("routed_experts"),
        )
    return Response.model_construct(
        id=response_id,
        created=int(span.end or time.time()),
        model=model,
        message=message,
        finish_reason=_finish_reason(step, message),
        usage=usage,
        tokens=turn_tokens,
        raw=None,
    )


def _delta_form(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Full-form steps (the protocol table's, from a gateway without the delta form) in
    the delta form, every other field kept."""
    out: list[dict[str, Any]] = []
    history: list[Any] = []
    history_ids: list[int] = []
    for step in steps:
        prompt = list(step.get("prompt") or ())
        shared = protocol.common_prefix_len(history, prompt)
        tokens = step.get("tokens")
        delta: dict[str, Any] | None = None
        if isinstance(tokens, Mapping):
            prompt_ids = list(tokens.get("prompt_ids") or ())
            shared_ids = protocol.common_prefix_len(history_ids, prompt_ids)
            delta = {
                **tokens,
                "prompt_shared": shared_ids,
                "prompt_new_ids": prompt_ids[shared_ids:],
            }
            history_ids = [*prompt_ids, *(tokens.get("completion_ids") or ())]
        else:
            history_ids = []
        out.append(
            {**step, "prompt_shared": shared, "prompt_new": prompt[shared:], "tokens": delta}
        )
        history = [*prompt, *(step.get("completion") or ())]
    return out


def _failure_key(failed: Mapping[str, Any]) -> tuple[Any, ...]:
    timing = failed.get("timing") or {}
    return (
        failed.get("after_steps"),
        timing.get("started_at") if isinstance(timing, Mapping) else None,
    )


class TraceSync:
    """Commits a rollout's recorded gateway turns into its v1 trace, each exchange once.

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
        #: v1's error for the latest exchange when it failed (``None`` when it was
        #: answered): what v1's server leaves on ``session.error``.
        self.last_failure: ProviderError | None = None
        self._failures_seen: set[tuple[Any, ...]] = set()
        # The previous step's prompt + completion (parsed once, reused by the steps that
        # extend it) and its ids.
        self._messages: list[Any] = []
        self._ids: list[int] = []
        self._tool_names: dict[str, str] = {}
        # The graph path of the previous step's messages (node ids, and the tokens held
        # by each prefix of it), when its commit covered all of them.
        self._path: list[int] | None = None
        self._path_tools: Any = None
        # The tools of the last step seen: the delta form sends a step's tools only when
        # they changed (protocol.StepExtras.tools).
        self._step_tools: Any = None
        self._sampling_cache: dict[bytes, Sampling | None] = {}
        self._tools_cache: dict[bytes, list[Any]] = {}
        # The provider path of the last step's dialect: a failed call's record says no
        # dialect, and an agent speaks one (chat before any step).
        self._endpoint = ChatDialect.upstream_path

    def apply(self, answer: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> int:
        """Commit the steps and failed calls of a trajectory answer not committed yet
        (the answer in the delta form or the full one; or its full-form steps alone, as
        earlier versions took them); returns how many steps were new."""
        if not isinstance(answer, Mapping):
            answer = {"trajectory": list(answer)}
        steps = answer.get("trajectory") or []
        if answer.get("format") != "delta":
            steps = _delta_form(steps)
        failed = [f for f in answer.get("failed_turns") or () if isinstance(f, Mapping)]
        pending = sorted(
            (f for f in failed if _failure_key(f) not in self._failures_seen),
            key=lambda f: (f.get("after_steps") or 0, _failure_key(f)[1] or 0.0),
        )
        before = len(self.trace.calls)
        new = steps[self.committed :]
        for offset, step in enumerate(new):
            index = self.committed + offset
            while pending and (pending[0].get("after_steps") or 0) <= index:
                self._record_failure(pending.pop(0))
            self._commit_step(index, step)
        self.committed = len(steps)
        for failure in pending:
            self._record_failure(failure)
        if len(self.trace.calls) != before:
            self.trace.notify()
        return len(new)

    # ------------------------------------------------------------------ failed calls

    def _record_failure(self, failed: Mapping[str, Any]) -> None:
        self._failures_seen.add(_failure_key(failed))
        error = failed.get("error") if isinstance(failed.get("error"), Mapping) else {}
        failure = provider_error(cast(Mapping[str, Any], error))
        self._record_failed_call(failure, self.sampling, _span(failed.get("timing")))

    # ------------------------------------------------------------------ steps

    def _sampling_of(self, extras: Mapping[str, Any]) -> Sampling | None:
        """A turn's ``ModelCall.sampling`` as v1's own interception records it: the
        agent's request with the env's sampling imposed (``ChatDialect.apply_overrides``),
        what was asked, not the bound the gateway sent the engine (``extras.sampling``,
        kept in ``trace.info``: :meth:`_note_upstream`). A step of a gateway that does
        not record the agent's own fields gives what was sent upstream."""
        asked = extras.get("agent_sampling")
        sent = extras.get("sampling")
        if isinstance(asked, Mapping):
            body = dict(asked)
            if isinstance(sent, Mapping) and sent.get("stop") is not None:
                body["stop"] = sent["stop"]  # the agent's stop, forwarded as it sent it
            if self.sampling is not None:
                body = _CHAT.apply_overrides(body, self.model, self.sampling)
                body.pop("model", None)
        elif isinstance(sent, Mapping):
            body = dict(sent)
        else:
            return self.sampling
        key = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        if key not in self._sampling_cache:  # turns of a rollout ask the same: parse once
            try:
                self._sampling_cache[key] = _CHAT.parse_sampling(body)
            except ValueError:
                self._sampling_cache[key] = self.sampling
        return self._sampling_cache[key]

    def _note_upstream(self, extras: Mapping[str, Any]) -> None:
        """Keep what the gateway sent the engine for the call about to be appended, in
        ``trace.info["rollout_gateway"]["upstream_sampling"]`` (``{"call": index,
        "sampling": ...}``), beside ``ModelCall.sampling``, what was asked."""
        sent = extras.get("sampling")
        if isinstance(sent, Mapping):
            info = self.trace.info.setdefault(TRACE_INFO_KEY, {})
            info.setdefault("upstream_sampling", []).append(
                {"call": len(self.trace.calls), "sampling": dict(sent)}
            )

    def _tools_of(self, raw: Any) -> list[Any] | None:
        """A turn's tools (when the gateway recorded them) as v1's dialect parses them."""
        if not raw:
            return None
        key = orjson.dumps(raw, option=orjson.OPT_SORT_KEYS)
        if key not in self._tools_cache:
            self._tools_cache[key] = list(_CHAT.parse_request({"tools": list(raw)}).tools or [])
        return self._tools_cache[key]

    def _parse(self, raw: Any, index: int) -> Any:
        """One request message as v1's chat dialect parses it (a tool result gets the name
        of the call it answers, from the history)."""
        try:
            message = parse_message(dict(raw))
        except (ValueError, KeyError, TypeError) as e:
            raise TraceSyncError(f"turn {index + 1}: unparseable message: {e}") from e
        if isinstance(message, ToolMessage) and message.name is None:
            name = self._tool_names.get(message.tool_call_id)
            if name is not None:
                message = message.model_copy(update={"name": name})
        elif isinstance(message, AssistantMessage):
            for call in message.tool_calls or []:
                self._tool_names[call.id] = call.name
        return message

    def _prompt(self, index: int, shared: int, new_raw: list[Any]) -> list[Any]:
        if shared > len(self._messages):
            raise TraceSyncError(f"turn {index + 1}: shares more messages than recorded")
        if shared < len(self._messages):
            self._tool_names = {}
            for message in self._messages[:shared]:
                if isinstance(message, AssistantMessage):
                    for call in message.tool_calls or []:
                        self._tool_names[call.id] = call.name
        return [*self._messages[:shared], *(self._parse(m, index) for m in new_raw)]

    def _commit_step(self, index: int, raw: Mapping[str, Any]) -> None:
        try:
            step: Mapping[str, Any] = protocol.parse_delta_step(raw)
        except protocol.BodyError as e:
            raise TraceSyncError(f"turn {index + 1}: {e}") from e
        extras = step["extras"]
        shared = step["prompt_shared"]
        new_raw = step["prompt_new"]
        completion_raw = step["completion"]
        extends = self._path is not None and shared == len(self._messages)
        prompt = self._prompt(index, shared, new_raw)
        tools_raw = step.get("tools", extras.get("tools", self._step_tools))
        self._step_tools = tools_raw
        tokens = step.get("tokens")
        tokens = tokens if isinstance(tokens, Mapping) else None
        prompt_ids = self._prompt_ids(tokens) if tokens is not None else None
        span = _span(extras.get("timing"))
        sampling = self._sampling_of(extras)
        self._note_upstream(extras)
        self._endpoint = _ENDPOINTS.get(extras.get("dialect"), ChatDialect.upstream_path)
        failure = _step_failure(step)
        if failure is not None or not completion_raw:
            # A failed exchange commits no node; v1 records the call with its error.
            failure = failure or ProviderError("the recorded turn has no answer", status_code=502)
            self._record_failed_call(failure, sampling, span)
            self._advance(prompt, None, prompt_ids, [], path=None, tools=tools_raw)
            return
        message = _assistant(completion_raw)
        response_id = f"{self.rollout_id}-turn-{index + 1}"
        response = _turn_response(step, message, tokens, prompt_ids, self.model, response_id, span)
        turn = self._pending_turn(prompt, tools_raw, extends, response.tokens)
        first_new = len(self.trace.nodes)
        node = turn.commit(response)
        if span.end:
            for created in self.trace.nodes[first_new:]:
                created.timestamp = span.end
        self.last_failure = None
        self._record_call(
            sampling, span, node=node, finish_reason=response.finish_reason, usage=response.usage
        )
        completion_ids = response.tokens.completion_ids if response.tokens is not None else []
        path = self._path_to(node)
        self._advance(prompt, message, prompt_ids, completion_ids, path=path, tools=tools_raw)

    def _record_failed_call(self, failure: ProviderError, sampling: Any, span: Any) -> None:
        """An exchange that produced no sample: one ``ModelCall`` with v1's error."""
        self.last_failure = failure
        self._record_call(sampling, span, error=_error_record(failure))

    def _record_call(self, sampling: Any, span: Any, **outcome: Any) -> None:
        """One exchange on the trace, as v1's server records it: its ``node``, finish
        reason and usage when it was answered, its ``error`` when not."""
        self.trace.calls.append(
            ModelCall(
                model=self.model, sampling=sampling, endpoint=self._endpoint, time=span, **outcome
            )
        )

    def _pending_turn(
        self, prompt: list[Any], tools_raw: Any, extends: bool, turn_tokens: Any
    ) -> PendingTurn:
        """Where the turn goes in the graph: on the previous step's path when it extends
        it (as ``prepare_turn`` would find it by hashing every message of the history
        again), else where ``prepare_turn`` puts it."""
        tools = self._tools_of(tools_raw)
        if not extends or (tools_raw or None) != (self._path_tools or None):
            return prepare_turn(self.trace, prompt, tools)
        assert self._path is not None
        path = self._path
        path_len = sum(len(self.trace.nodes[n].token_ids) for n in path)
        if turn_tokens is not None:
            # The new messages' tokens are not told apart (no renderer spans): they land
            # on the assistant node, as without spans. Said with empty spans at the
            # prefix's end, commit places them without scanning every node for a
            # concurrent commit of the same message (there is none in a replay).
            new_messages = len(prompt) - len(path)
            turn_tokens.message_spans = [None] * len(path) + [(path_len, path_len)] * new_messages
        return PendingTurn(
            trace=self.trace,
            prompt=prompt,
            tools=list(tools or []),
            prefix_node_ids=list(path),
            path_len=path_len,
        )

    def _prompt_ids(self, tokens: Mapping[str, Any]) -> list[int]:
        """A delta step's prompt ids: the history's first ``prompt_shared`` ids, then its
        new ones. When it extends the whole history (the usual case) the history's own
        list grows in place: v1's commit keeps slices of it, never the list, so each turn
        costs what it adds, not the context."""
        shared = int(tokens.get("prompt_shared") or 0)
        new = tokens.get("prompt_new_ids") or ()
        if shared == len(self._ids):
            ids = self._ids
            ids.extend(new)
            self._ids = []  # handed to this turn; _advance takes it back
            return ids
        return [*self._ids[:shared], *new]

    def _path_to(self, node: int) -> list[int]:
        path: list[int] = []
        current: int | None = node
        while current is not None:
            path.append(current)
            current = self.trace.nodes[current].parent
        path.reverse()
        return path

    def _advance(
        self,
        prompt: list[Any],
        message: Any,
        prompt_ids: list[int] | None,
        completion_ids: list[int],
        *,
        path: list[int] | None,
        tools: Any,
    ) -> None:
        """The history the next step extends: this step's prompt + completion."""
        self._messages = [*prompt, *([message] if message is not None else [])]
        if message is not None:
            for call in message.tool_calls or []:
                self._tool_names[call.id] = call.name
        if prompt_ids is not None:
            prompt_ids.extend(completion_ids)  # the turn is committed: the list is ours
            self._ids = prompt_ids
        else:
            self._ids = []
        # The path holds the messages only when the commit placed all of them (one node
        # per message: no placeholder messages the graph drops).
        self._path = path if path is not None and len(path) == len(self._messages) else None
        self._path_tools = tools


__all__ = ["FINISH_REASONS", "TraceSync", "TraceSyncError"]
