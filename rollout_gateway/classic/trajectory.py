"""Turn a gateway trajectory answer into verifiers' rollout state.

The gateway answers with OpenAI-format messages and per-step token records
(:class:`rollout_gateway.protocol.TrajectoryResponse`); verifiers wants
``vf.TrajectoryStep`` dicts with provider-agnostic messages, a ``vf.Response`` per step
(its usage feeds verifiers' token accounting) and ``tokens`` for the trainer. A field
the gateway did not send never erases what the state already had.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from verifiers.types import (
    Messages,
    Response,
    ResponseMessage,
    ResponseTokens,
    State,
    TimeSpan,
    ToolCall,
    TrajectoryStep,
    TrajectoryStepTokens,
    Usage,
)
from verifiers.utils.message_utils import normalize_messages

from rollout_gateway.classic.stops import TRUNCATING_STOPS, limit_stop
from rollout_gateway.errors import GatewayProtocolError
from rollout_gateway.protocol import common_prefix_len

_TOKEN_LIST_FIELDS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "completion_logprobs",
)


def convert_messages(raw: object, where: str) -> Messages:
    """OpenAI-format message dicts -> verifiers messages (typed error when malformed)."""
    if not isinstance(raw, list):
        raise GatewayProtocolError(f"{where}: expected a list of messages")
    try:
        return normalize_messages(cast(Any, raw), field_name=where)
    except (KeyError, TypeError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        raise GatewayProtocolError(f"{where}: malformed message: {e}") from e


class MessageCache:
    """Converts the messages of successive steps, reusing the shared history prefix.

    Step ``k``'s prompt repeats every message of steps ``< k``; converting each anew
    makes a long rollout quadratic. Equal raw messages at the same position map to the
    same verifiers message object, as verifiers' own multi-turn loop shares them.
    """

    def __init__(self) -> None:
        self._raw: list[Any] = []
        self._converted: Messages = []

    def convert(self, raw: object, where: str) -> Messages:
        """Like :func:`convert_messages`, with the prefix shared with earlier calls reused."""
        if not isinstance(raw, list):
            raise GatewayProtocolError(f"{where}: expected a list of messages")
        same = common_prefix_len(self._raw, raw)
        fresh = convert_messages(raw[same:], where) if same < len(raw) else []
        result = self._converted[:same] + fresh
        if same < len(raw):  # raw extends or rewrites the cached history; a prefix keeps it
            self._raw, self._converted = list(raw), result
        return result


def convert_tokens(raw: object, where: str) -> TrajectoryStepTokens | None:
    """A step's token record, checked for the fields and lengths a trainer relies on."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise GatewayProtocolError(f"{where}: 'tokens' is not an object")
    missing = [f for f in _TOKEN_LIST_FIELDS if not isinstance(raw.get(f), list)]
    if missing:
        raise GatewayProtocolError(f"{where}: 'tokens' lacks lists {missing}")
    if len(raw["prompt_ids"]) != len(raw["prompt_mask"]):
        raise GatewayProtocolError(f"{where}: prompt_ids and prompt_mask differ in length")
    n = len(raw["completion_ids"])
    if len(raw["completion_mask"]) != n or len(raw["completion_logprobs"]) != n:
        raise GatewayProtocolError(
            f"{where}: completion_ids, completion_mask and completion_logprobs differ in length"
        )
    # The answer's lists are the client's own (decoded or expanded for this call): kept,
    # not copied (a long rollout's prompt ids are most of its memory).
    tokens: dict[str, Any] = {f: raw[f] for f in _TOKEN_LIST_FIELDS}
    tokens["overlong_prompt"] = bool(raw.get("overlong_prompt", False))
    tokens["is_truncated"] = bool(raw.get("is_truncated", False))
    tokens["routed_experts"] = raw.get("routed_experts")
    return cast(TrajectoryStepTokens, tokens)


def finish_reason(tool_calls: object, is_truncated: bool, extras: Mapping[str, Any] | None) -> str:
    """A step's finish reason in verifiers' words: tool calls, else what the engine said
    (when verifiers knows the word), else ``length`` for a truncated step, else ``stop``."""
    engine_finish = (extras or {}).get("finish_reason")
    if tool_calls:
        return "tool_calls"
    if engine_finish in ("stop", "length", "tool_calls"):
        return str(engine_finish)
    return "length" if is_truncated else "stop"


def usage_and_tokens(
    tokens: TrajectoryStepTokens | None,
) -> tuple[Usage | None, ResponseTokens | None]:
    """A step's usage (counted from its token ids) and its ``ResponseTokens``."""
    if tokens is None:
        return None, None
    prompt_n, completion_n = len(tokens["prompt_ids"]), len(tokens["completion_ids"])
    usage = Usage.model_construct(
        prompt_tokens=prompt_n,
        completion_tokens=completion_n,
        reasoning_tokens=0,
        total_tokens=prompt_n + completion_n,
    )
    # Already checked by convert_tokens: share the lists instead of re-validating every
    # element (the costliest part of a 500-rollout burst otherwise).
    response_tokens = ResponseTokens.model_construct(
        prompt_ids=tokens["prompt_ids"],
        prompt_mask=tokens["prompt_mask"],
        completion_ids=tokens["completion_ids"],
        completion_mask=tokens["completion_mask"],
        completion_logprobs=tokens["completion_logprobs"],
        routed_experts=None,
        multi_modal_data=None,
        prompt_attribution=None,
    )
    return usage, response_tokens


def synthesize_response(
    completion: Messages,
    tokens: TrajectoryStepTokens | None,
    *,
    response_id: str,
    model: str,
    is_truncated: bool,
    extras: Mapping[str, Any] | None = None,
) -> Response:
    """A ``vf.Response`` for a gateway step: last assistant message, usage from tokens.

    verifiers derives token usage and context metrics from each step's response, so the
    gateway path must carry one just as the interception path does.
    """
    assistant = next(
        (m for m in reversed(completion) if getattr(m, "role", None) == "assistant"), None
    )
    content = getattr(assistant, "content", None) if assistant is not None else ""
    tool_calls = cast(list[ToolCall] | None, getattr(assistant, "tool_calls", None))
    usage, response_tokens = usage_and_tokens(tokens)
    # Built from values of known types (the messages were validated on conversion):
    # constructed, not re-validated, as for the tokens.
    return Response.model_construct(
        id=response_id,
        created=int(time.time()),
        model=model,
        usage=usage,
        message=ResponseMessage.model_construct(
            content=content,
            reasoning_content=getattr(assistant, "reasoning_content", None),
            tool_calls=tool_calls or None,
            finish_reason=finish_reason(tool_calls, is_truncated, extras),
            is_truncated=is_truncated,
            tokens=response_tokens,
        ),
    )


def convert_step(
    raw: object,
    index: int,
    *,
    model: str,
    default_trajectory_id: str,
    cache: MessageCache | None = None,
) -> TrajectoryStep:
    """One gateway step -> ``vf.TrajectoryStep``."""
    where = f"trajectory[{index}]"
    if not isinstance(raw, Mapping):
        raise GatewayProtocolError(f"{where} is not an object")
    extras = raw.get("extras")
    extras = extras if isinstance(extras, Mapping) else {}
    cache = cache or MessageCache()
    prompt = cache.convert(raw.get("prompt", []), f"{where}.prompt")
    completion = convert_messages(raw.get("completion", []), f"{where}.completion")
    tokens = convert_tokens(raw.get("tokens"), where)
    is_truncated = bool(raw.get("is_truncated", False)) or bool(
        tokens is not None and tokens["is_truncated"]
    )
    trajectory_id = str(raw.get("trajectory_id") or default_trajectory_id)
    return TrajectoryStep(
        prompt=prompt,
        completion=completion,
        response=synthesize_response(
            completion,
            tokens,
            response_id=f"{trajectory_id}-{index}",
            model=model,
            is_truncated=is_truncated,
            extras=extras,
        ),
        tokens=tokens,
        reward=raw.get("reward"),
        advantage=raw.get("advantage"),
        is_truncated=is_truncated,
        trajectory_id=trajectory_id,
        extras=dict(extras),
    )


def apply_trajectory(state: State, answer: Mapping[str, Any]) -> list[TrajectoryStep]:
    """Write a trajectory answer into ``state``; returns the converted steps.

    Sets ``trajectory`` (when sent), ``prompt`` (when sent and non-empty),
    ``gateway_completion`` (the answer's ``completion``, rendered into ``completion`` by
    the mixin), ``is_truncated`` (only ever raised, never lowered; as ``CliAgentEnv``
    counts it, see :mod:`.stops`) and
    ``gateway_status`` / ``gateway_num_turns``. Nothing is erased for a missing field.
    """
    model = str(answer.get("model") or state.get("model") or "")
    steps: list[TrajectoryStep] = []
    cache = MessageCache()
    raw_steps = answer.get("trajectory")
    if raw_steps is not None:
        if not isinstance(raw_steps, Sequence) or isinstance(raw_steps, str | bytes):
            raise GatewayProtocolError("trajectory answer: 'trajectory' is not a list")
        default_id = str(state.get("trajectory_id") or "")
        steps = [
            convert_step(raw, i, model=model, default_trajectory_id=default_id, cache=cache)
            for i, raw in enumerate(raw_steps)
        ]
        state["trajectory"] = steps
    # The top-level prompt and completion are the last step's conversation: reuse it.
    prompt = answer.get("prompt")
    prompt_messages = prompt if isinstance(prompt, list) else []
    if prompt_messages:
        state["prompt"] = cache.convert(prompt_messages, "prompt")
    completion = answer.get("completion")
    if isinstance(completion, list):
        conversation = cache.convert(prompt_messages + completion, "completion")
        state["gateway_completion"] = conversation[len(prompt_messages) :]
    # As CliAgentEnv counts it: a truncated turn, or a limit that truncates by itself
    # (prompt_too_long); not the turn count or the completion budget (.stops).
    reason = answer.get("truncation_reason")
    stop = limit_stop(reason)
    top_level = bool(answer.get("is_truncated")) and (stop is None or stop in TRUNCATING_STOPS)
    if top_level or any(s["is_truncated"] for s in steps):
        state["is_truncated"] = True
    if "status" in answer:
        state["gateway_status"] = answer["status"]
    if "num_turns" in answer:
        state["gateway_num_turns"] = answer["num_turns"]
    # The reference gateway's optional additions, kept for the trainer when sent.
    if answer.get("truncation_reason"):
        state["gateway_truncation_reason"] = answer["truncation_reason"]
    if steps:
        _record_model_time(state, steps)
        versions = [s["extras"].get("policy_version") for s in steps]
        if any(v is not None for v in versions):
            state["policy_versions"] = versions
            # A turn sampled across a weight update, or by an older policy than the last.
            latest = max(v for v in versions if v is not None)
            state["stale_turns"] = [
                i
                for i, s in enumerate(steps)
                if s["extras"].get("policy_version_end") is not None
                or (versions[i] is not None and versions[i] < latest)
            ]
    return steps


def _record_model_time(state: State, steps: Sequence[TrajectoryStep]) -> None:
    """``timing.model``: one span per turn, the upstream call the gateway timed (what
    verifiers' own loop records around each model call)."""
    model = getattr(state.get("timing"), "model", None)
    if model is None or not hasattr(model, "spans"):
        return
    spans = []
    for step in steps:
        timing = step["extras"].get("timing")
        if not isinstance(timing, Mapping):
            continue
        start, took = timing.get("started_at"), timing.get("upstream_s")
        if isinstance(start, int | float) and isinstance(took, int | float):
            spans.append(TimeSpan(start=float(start), end=float(start) + float(took)))
    model.spans = spans


def recorded_tools(steps: Sequence[TrajectoryStep]) -> list[dict[str, Any]] | None:
    """The agent's tool definitions as the gateway recorded them (the last turn's), or
    None when it recorded none."""
    for step in reversed(steps):
        tools = step["extras"].get("tools")
        if isinstance(tools, list):
            return tools
    return None


__all__ = [
    "MessageCache",
    "apply_trajectory",
    "convert_messages",
    "convert_step",
    "convert_tokens",
    "recorded_tools",
    "synthesize_response",
]
