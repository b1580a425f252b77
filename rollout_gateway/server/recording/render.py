"""A recorded trajectory in the protocol's shapes: every step whole (:func:`full_steps`)
or each step as what its predecessor does not hold (:func:`delta_steps`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_gateway.protocol import StepTokens, TrajectoryStepBody
from rollout_gateway.server.recording.steps import RecordedStep


def full_steps(steps: Sequence[RecordedStep], trajectory_id: str) -> list[TrajectoryStepBody]:
    """The kept ``steps`` of trajectory ``trajectory_id``, each rebuilt whole in the
    protocol's shape (its prompt messages and ids from its predecessors')."""
    out: list[TrajectoryStepBody] = []
    prev_messages: list[dict[str, Any]] = []
    for step in steps:
        if step.abandoned:
            continue  # the next step extends the history before this one
        prompt = [*prev_messages[: step.shared_messages], *step.new_messages]
        body_tokens: StepTokens | None = None
        if step.tokens is not None:
            t = step.tokens
            body_tokens = {
                "prompt_ids": t.segment[: t.prompt_end].tolist(),
                "prompt_mask": [0] * t.prompt_end,
                "completion_ids": t.segment[t.prompt_end : t.completion_end].tolist(),
                "completion_mask": [1] * (t.completion_end - t.prompt_end),
                "completion_logprobs": t.completion_logprobs.tolist(),
                "overlong_prompt": t.overlong_prompt,
                "is_truncated": t.is_truncated,
            }
            if step.routed_experts is not None:
                body_tokens["routed_experts"] = step.routed_experts
        prev_messages = [*prompt, *step.completion]
        out.append(
            {
                "prompt": prompt,
                "completion": list(step.completion),
                "tokens": body_tokens,
                "reward": None,
                "advantage": None,
                "is_truncated": step.is_truncated,
                "trajectory_id": trajectory_id,
                "extras": dict(step.extras),
            }
        )
    return out


def delta_steps(steps: Sequence[RecordedStep], trajectory_id: str) -> list[dict[str, Any]]:
    """The kept ``steps`` in the delta form (see
    :func:`rollout_gateway.protocol.expand_delta_steps`): each holds only what its
    predecessor's prompt + completion does not. The step after an abandoned one is stored
    against the history before it (see :meth:`.TrajectoryRecorder.abandon_last`), i.e.
    against the previous step kept."""
    out: list[dict[str, Any]] = []
    tools: Any = None
    for step in steps:
        if step.abandoned:
            continue
        extras = step.extras
        if "tools" in extras:
            if extras["tools"] is tools:  # as the previous step's: carried forward
                extras = {k: v for k, v in extras.items() if k != "tools"}
            else:
                tools = extras["tools"]
        body_tokens: dict[str, Any] | None = None
        if step.tokens is not None:
            t = step.tokens
            body_tokens = {
                "prompt_shared": t.prefix_len,
                "prompt_new_ids": t.segment[t.prefix_len : t.prompt_end].tolist(),
                "completion_ids": t.segment[t.prompt_end : t.completion_end].tolist(),
                "completion_logprobs": t.completion_logprobs.tolist(),
                "overlong_prompt": t.overlong_prompt,
                "is_truncated": t.is_truncated,
            }
            if step.routed_experts is not None:
                body_tokens["routed_experts"] = step.routed_experts
        out.append(
            {
                "prompt_shared": step.shared_messages,
                "prompt_new": step.new_messages,
                "completion": step.completion,
                "tokens": body_tokens,
                "reward": None,
                "advantage": None,
                "is_truncated": step.is_truncated,
                "trajectory_id": trajectory_id,
                "extras": extras,
            }
        )
    return out


__all__ = ["delta_steps", "full_steps"]
