"""Server-side trajectory recording: one step per turn, token ids stored compactly.

Memory matters: a rollout of ``T`` turns over a context of ``N`` tokens has ``O(T * N)``
logical prompt tokens (every turn repeats the history). The recorder stores each step's
prompt as "the first ``k`` tokens of the previous step's prompt+completion" plus a tail,
in ``array('i')`` (4 bytes per id) and logprobs in ``array('f')`` (4 bytes, float32), so
memory grows with the *unique* tokens of the rollout. Messages are shared the same way
(references to the previous step's message dicts). Full steps are rebuilt on demand when
the trajectory is fetched.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway.protocol import StepTokens, TrajectoryStepBody


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) if isinstance(part, Mapping) else str(part)
            for part in content
        )
    return json.dumps(content, sort_keys=True)


def message_key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two chat messages "the same" when checking that history is extended.

    SDKs re-serialise assistant messages with cosmetic differences (``content: null`` vs
    ``""``, extra ``refusal: null``, text parts vs string); those must not count as a
    rewritten history.
    """
    calls = tuple(
        (
            str(c.get("id", "")),
            str((c.get("function") or {}).get("name", "")),
            _canonical_arguments((c.get("function") or {}).get("arguments", "")),
        )
        for c in (message.get("tool_calls") or ())
        if isinstance(c, Mapping)
    )
    return (
        message.get("role"),
        _text(message.get("content")),
        calls,
        message.get("tool_call_id") or "",
        message.get("name") or "",
    )


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


#: Message fields the trajectory keeps; everything else an agent sends (vendor extras,
#: cache hints, ids...) is dropped when the message is stored, so it costs no memory.
RECORDED_MESSAGE_FIELDS = (
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
)


def recorded_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a chat message the trajectory keeps (see :data:`RECORDED_MESSAGE_FIELDS`)."""
    return {k: message[k] for k in RECORDED_MESSAGE_FIELDS if k in message}


def _common_prefix_len(a: array, b: array) -> int:
    """Length of the longest common prefix of two id arrays (slice compares run in C)."""
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


@dataclass(slots=True)
class _Tokens:
    prefix_len: int  # leading ids shared with the previous step's prompt+completion
    prompt_tail: array
    completion_ids: array
    completion_logprobs: array
    overlong_prompt: bool
    is_truncated: bool


@dataclass(slots=True)
class _Step:
    shared_messages: int  # leading messages shared with the previous prompt+completion
    new_messages: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    tokens: _Tokens | None
    is_truncated: bool
    extras: dict[str, Any]
    abandoned: bool = False  # nobody received the answer: not a turn the agent saw


@dataclass
class TrajectoryRecorder:
    """The steps of one rollout.

    Args:
        trajectory_id: id reported on every step (a uuid per rollout).
        max_seq_len: context bound used for ``overlong_prompt`` / ``is_truncated``.
    """

    trajectory_id: str
    max_seq_len: int | None = None
    _steps: list[_Step] = field(default_factory=list)
    _last_messages: list[dict[str, Any]] = field(default_factory=list)
    _last_ids: array = field(default_factory=lambda: array("i"))
    #: ``(_last_messages, _last_ids)`` before the last step (to undo an abandoned turn).
    _before_last: tuple[list[dict[str, Any]], array] | None = None

    @property
    def num_steps(self) -> int:
        """Number of recorded turns."""
        return len(self._steps)

    @property
    def last_context_tokens(self) -> int:
        """Prompt + completion ids of the last turn (0 when it had no ids)."""
        return len(self._last_ids)

    def shared_messages(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """How many leading ``messages`` the last turn's prompt + completion holds already.

        ``None`` when ``messages`` does not extend that history (it was rewritten).
        """
        shared = len(self._last_messages)
        if not self._steps:
            return 0
        if len(messages) >= shared and all(
            m == p or message_key(m) == message_key(p)  # == first: C speed
            for m, p in zip(messages, self._last_messages, strict=False)
        ):
            return shared
        return None

    def abandon_last(self) -> None:
        """Mark the last step abandoned (its answer reached nobody) and forget it as the
        history the next turn extends."""
        if self._steps and not self._steps[-1].abandoned and self._before_last is not None:
            self._steps[-1].abandoned = True
            self._last_messages, self._last_ids = self._before_last
            self._before_last = None

    @property
    def num_abandoned(self) -> int:
        """Steps recorded as abandoned."""
        return sum(1 for s in self._steps if s.abandoned)

    def record(
        self,
        messages: Sequence[dict[str, Any]],
        completion: Sequence[dict[str, Any]],
        *,
        prompt_ids: Sequence[int] | None = None,
        completion_ids: Sequence[int] | None = None,
        completion_logprobs: Sequence[float] | None = None,
        finish_reason: str | None = None,
        total_tokens: int | None = None,
        shared: int | None = -1,
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        """Record one turn: the request's ``messages`` and the returned ``completion``.

        Token fields are kept only when ``prompt_ids``, ``completion_ids`` and
        ``completion_logprobs`` are all given and consistent; otherwise the step has
        ``tokens: null`` (still recorded). ``total_tokens`` (usage) is the fallback
        length for ``is_truncated`` when there are no ids.
        """
        step_extras: dict[str, Any] = dict(extras or {})
        if shared == -1:  # not computed by the caller
            shared = self.shared_messages(messages)
        if shared is None:
            step_extras["history_rewritten"] = True
            shared = 0
        new_messages = [recorded_message(m) for m in messages[shared:]]
        truncated = finish_reason == "length"
        extras = step_extras
        before = (self._last_messages, self._last_ids)

        tokens: _Tokens | None = None
        have_ids = prompt_ids is not None and completion_ids is not None
        if have_ids and completion_logprobs is not None:
            if len(completion_logprobs) != len(completion_ids):  # type: ignore[arg-type]
                extras["tokens_error"] = "logprobs and token ids differ in length"
            else:
                try:
                    tokens = self._make_tokens(prompt_ids, completion_ids, completion_logprobs)  # type: ignore[arg-type]
                except (TypeError, ValueError, OverflowError):
                    extras["tokens_error"] = "token ids are not 32-bit integers"
                else:
                    truncated = truncated or tokens.is_truncated
                    if not math.isfinite(sum(tokens.completion_logprobs)):
                        # Served as null (JSON has no NaN/inf); the turn says so.
                        extras["nonfinite_logprobs"] = sum(
                            1 for x in tokens.completion_logprobs if not math.isfinite(x)
                        )
        if tokens is None:
            self._last_ids = array("i")
            if self.max_seq_len is not None and total_tokens is not None:
                truncated = truncated or total_tokens > self.max_seq_len
        if tokens is not None:
            tokens.is_truncated = tokens.is_truncated or truncated

        completion_list = [dict(m) for m in completion]
        self._steps.append(_Step(shared, new_messages, completion_list, tokens, truncated, extras))
        self._last_messages = [*self._last_messages[:shared], *new_messages, *completion_list]
        self._before_last = before

    def _make_tokens(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float]
    ) -> _Tokens:
        prompt = array("i", prompt_ids)
        comp = array("i", completion_ids)
        prefix = _common_prefix_len(self._last_ids, prompt)
        overlong = self.max_seq_len is not None and len(prompt) > self.max_seq_len
        too_long = self.max_seq_len is not None and len(prompt) + len(comp) > self.max_seq_len
        tokens = _Tokens(prefix, prompt[prefix:], comp, array("f", logprobs), overlong, too_long)
        prompt.extend(comp)
        self._last_ids = prompt  # the next turn's prompt usually extends this
        return tokens

    def steps(self) -> list[TrajectoryStepBody]:
        """All steps, rebuilt in the protocol's shape."""
        out: list[TrajectoryStepBody] = []
        prev_messages: list[dict[str, Any]] = []
        prev_ids = array("i")
        for step in self._steps:
            prompt = [*prev_messages[: step.shared_messages], *step.new_messages]
            body_tokens: StepTokens | None = None
            if step.tokens is not None:
                t = step.tokens
                prompt_ids = prev_ids[: t.prefix_len] + t.prompt_tail
                body_tokens = {
                    "prompt_ids": prompt_ids.tolist(),
                    "prompt_mask": [0] * len(prompt_ids),
                    "completion_ids": t.completion_ids.tolist(),
                    "completion_mask": [1] * len(t.completion_ids),
                    "completion_logprobs": t.completion_logprobs.tolist(),
                    "overlong_prompt": t.overlong_prompt,
                    "is_truncated": t.is_truncated,
                }
                next_ids = prompt_ids + t.completion_ids
            else:
                next_ids = array("i")
            if step.abandoned:
                continue  # the next step extends the history before this one
            prev_ids = next_ids
            prev_messages = [*prompt, *step.completion]
            out.append(
                {
                    "prompt": prompt,
                    "completion": list(step.completion),
                    "tokens": body_tokens,
                    "reward": None,
                    "advantage": None,
                    "is_truncated": step.is_truncated,
                    "trajectory_id": self.trajectory_id,
                    "extras": dict(step.extras),
                }
            )
        return out

    def summary(
        self, steps: list[TrajectoryStepBody] | None = None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
        """Top-level ``(prompt, completion, is_truncated)`` of the trajectory.

        ``prompt`` is the first request's messages; ``completion`` is everything after it
        in the last turn (its request messages beyond the first prompt, then its answer).
        """
        steps = self.steps() if steps is None else steps
        if not steps:
            return [], [], False
        first = steps[0]["prompt"]
        last = steps[-1]
        completion = [*last["prompt"], *last["completion"]][len(first) :]
        return list(first), completion, any(s["is_truncated"] for s in steps)

    def token_storage_bytes(self) -> int:
        """Bytes held by the token arrays (ids, logprobs and the last-turn cache)."""
        total = self._last_ids.buffer_info()[1] * self._last_ids.itemsize
        for step in self._steps:
            if step.tokens is not None:
                for arr in (
                    step.tokens.prompt_tail,
                    step.tokens.completion_ids,
                    step.tokens.completion_logprobs,
                ):
                    total += arr.buffer_info()[1] * arr.itemsize
        return total

    def logical_token_count(self) -> int:
        """Tokens the trajectory reports (sum over steps of prompt + completion ids)."""
        return sum(
            s.tokens.prefix_len + len(s.tokens.prompt_tail) + len(s.tokens.completion_ids)
            for s in self._steps
            if s.tokens is not None
        )


__all__ = ["TrajectoryRecorder", "message_key"]
