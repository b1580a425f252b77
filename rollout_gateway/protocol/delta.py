"""The trajectory's delta form: each step holds only what the previous one does not.

``GET /v1/rollouts/{id}/trajectory?format=delta`` (our addition; without the parameter
the answer is the protocol table's full form) answers ``"format": "delta"`` and each
step, instead of ``prompt`` and ``tokens.prompt_ids`` / masks, holds ``prompt_shared``
(how many leading messages of the previous step's prompt + completion it reuses),
``prompt_new`` (the messages after those), and in ``tokens`` ``prompt_shared`` /
``prompt_new_ids`` (the same for token ids). Masks are implied (prompt 0s, completion
1s). :func:`expand_delta_steps` rebuilds the full steps, :func:`delta_steps` makes the
delta form of full ones, :func:`parse_delta_step` checks one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict, cast

from rollout_gateway.protocol.errors import BodyError
from rollout_gateway.protocol.schema import StepTokens, TrajectoryStepBody

#: The trajectory call's query asking for the delta form.
TRAJECTORY_DELTA_QUERY = {"format": "delta"}


class DeltaTokens(TypedDict):
    """A delta step's ``tokens``: its prompt ids beyond those it shares, and its sample."""

    prompt_shared: int
    prompt_new_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    overlong_prompt: bool
    is_truncated: bool
    routed_experts: NotRequired[dict[str, Any]]


class DeltaStepBody(TypedDict):
    """One step of a trajectory answer in the delta form."""

    prompt_shared: int
    prompt_new: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    tokens: DeltaTokens | None
    reward: float | None
    advantage: float | None
    is_truncated: bool
    trajectory_id: str
    extras: dict[str, Any]


def _count(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BodyError(f"'{key}' must be a non-negative integer")
    return value


def _list(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list):
        raise BodyError(f"'{key}' must be a list")
    return value


def _flag(data: dict[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise BodyError(f"'{key}' must be true or false")
    return value


def _parse_tokens(data: Any) -> DeltaTokens | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise BodyError("'tokens' must be an object or null")
    tokens = {
        **data,
        "prompt_shared": _count(data, "prompt_shared"),
        "prompt_new_ids": _list(data, "prompt_new_ids"),
        "completion_ids": _list(data, "completion_ids"),
        "completion_logprobs": _list(data, "completion_logprobs"),
        "overlong_prompt": _flag(data, "overlong_prompt"),
        "is_truncated": _flag(data, "is_truncated"),
    }
    return cast(DeltaTokens, tokens)


def parse_delta_step(data: Any) -> DeltaStepBody:
    """One delta-form step, checked (a copy; keys it does not know are kept). What a
    gateway may leave out has its default: ``tokens``, ``reward`` and ``advantage``
    ``None``, ``extras`` ``{}``, the flags false, ``trajectory_id`` ``""``. Token id
    lists are not checked element by element (a long context's ids). Raises
    :class:`~.errors.BodyError`."""
    if not isinstance(data, dict):
        raise BodyError("a step must be an object")
    extras = data.get("extras")
    if extras is not None and not isinstance(extras, dict):
        raise BodyError("'extras' must be an object")
    trajectory_id = data.get("trajectory_id", "")
    if not isinstance(trajectory_id, str):
        raise BodyError("'trajectory_id' must be a string")
    step = {
        **data,
        "prompt_shared": _count(data, "prompt_shared"),
        "prompt_new": _list(data, "prompt_new"),
        "completion": _list(data, "completion"),
        "tokens": _parse_tokens(data.get("tokens")),
        "reward": data.get("reward"),
        "advantage": data.get("advantage"),
        "is_truncated": _flag(data, "is_truncated"),
        "trajectory_id": trajectory_id,
        "extras": extras or {},
    }
    return cast(DeltaStepBody, step)


def expand_delta_steps(steps: Sequence[Any]) -> list[TrajectoryStepBody]:
    """Full trajectory steps (the protocol table's shape) from delta-form ``steps``.
    Raises :class:`~.errors.BodyError` naming a malformed step."""
    out: list[TrajectoryStepBody] = []
    history: list[dict[str, Any]] = []
    history_ids: list[int] = []
    tools: Any = None
    for index, raw in enumerate(steps):
        try:
            step = parse_delta_step(raw)
        except BodyError as e:
            raise BodyError(f"malformed delta step {index}: {e}") from None
        extras = dict(step["extras"])
        if "tools" in extras:
            tools = extras["tools"]
        elif tools is not None:
            extras["tools"] = tools  # unchanged since the step that sent them
        prompt = [*history[: step["prompt_shared"]], *step["prompt_new"]]
        full_tokens: StepTokens | None = None
        delta = step["tokens"]
        if delta is not None:
            prompt_ids = [*history_ids[: delta["prompt_shared"]], *delta["prompt_new_ids"]]
            completion_ids = delta["completion_ids"]
            full_tokens = {
                "prompt_ids": prompt_ids,
                "prompt_mask": [0] * len(prompt_ids),
                "completion_ids": completion_ids,
                "completion_mask": [1] * len(completion_ids),
                "completion_logprobs": delta["completion_logprobs"],
                "overlong_prompt": delta["overlong_prompt"],
                "is_truncated": delta["is_truncated"],
            }
            if delta.get("routed_experts") is not None:
                full_tokens["routed_experts"] = delta["routed_experts"]
            history_ids = [*prompt_ids, *completion_ids]
        else:
            history_ids = []
        history = [*prompt, *step["completion"]]
        out.append(
            {
                "prompt": prompt,
                "completion": step["completion"],
                "tokens": full_tokens,
                "reward": step["reward"],
                "advantage": step["advantage"],
                "is_truncated": step["is_truncated"],
                "trajectory_id": step["trajectory_id"],
                "extras": extras,
            }
        )
    return out


def delta_steps(steps: list[TrajectoryStepBody]) -> list[DeltaStepBody]:
    """The delta form of full ``steps`` (the inverse of :func:`expand_delta_steps`).

    For gateways (and fakes) that store full steps; each step's prompt is expressed
    against the previous step's prompt + completion, messages and token ids alike.
    """
    out: list[DeltaStepBody] = []
    history: list[dict[str, Any]] = []
    history_ids: list[int] = []
    tools: Any = None
    for step in steps:
        prompt = step["prompt"]
        shared = common_prefix_len(history, prompt)
        extras = dict(step.get("extras") or {})
        if "tools" in extras:
            if extras["tools"] == tools:
                del extras["tools"]  # as the previous step's: carried forward on expansion
            else:
                tools = extras["tools"]
        delta: DeltaTokens | None = None
        tokens = step["tokens"]
        if tokens is not None:
            prompt_ids = tokens["prompt_ids"]
            shared_ids = common_prefix_len(history_ids, prompt_ids)
            delta = {
                "prompt_shared": shared_ids,
                "prompt_new_ids": prompt_ids[shared_ids:],
                "completion_ids": tokens["completion_ids"],
                "completion_logprobs": tokens["completion_logprobs"],
                "overlong_prompt": tokens["overlong_prompt"],
                "is_truncated": tokens["is_truncated"],
            }
            if tokens.get("routed_experts") is not None:
                delta["routed_experts"] = tokens["routed_experts"]
            history_ids = [*prompt_ids, *tokens["completion_ids"]]
        else:
            history_ids = []
        out.append(
            {
                "prompt_shared": shared,
                "prompt_new": prompt[shared:],
                "completion": step["completion"],
                "tokens": delta,
                "reward": step.get("reward"),
                "advantage": step.get("advantage"),
                "is_truncated": step["is_truncated"],
                "trajectory_id": step["trajectory_id"],
                "extras": extras,
            }
        )
        history = [*prompt, *step["completion"]]
    return out


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (lists, id arrays).

    Slice comparisons run in C: one when ``b`` extends ``a`` (the usual case), else a
    binary search over prefix lengths.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


__all__ = [
    "TRAJECTORY_DELTA_QUERY",
    "DeltaStepBody",
    "DeltaTokens",
    "common_prefix_len",
    "delta_steps",
    "expand_delta_steps",
    "parse_delta_step",
]
