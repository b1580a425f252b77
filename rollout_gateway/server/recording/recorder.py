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

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway.protocol import TrajectoryStepBody
from rollout_gateway.server.recording.history import (
    RECORDED_MESSAGE_FIELDS,
    HistoryMatch,
    MessageHistory,
    message_key,
    recorded_message,
    same_message,
)
from rollout_gateway.server.recording.prompt_ids import IdsText
from rollout_gateway.server.recording.render import delta_steps, full_steps
from rollout_gateway.server.recording.steps import CheckState, RecordedStep, StepDelta
from rollout_gateway.server.recording.token_branches import StepIds, TokenBranches

#: Finish reasons that mean "the model did not end its turn itself": the sample is cut.
#: ``abort``: the engine aborted the request (vLLM, SGLang); ``repetition``: a
#: repetition detector stopped it; ``error``: the engine failed mid-generation.
TRUNCATING_FINISH_REASONS = frozenset({"length", "abort", "repetition", "error"})


@dataclass
class TrajectoryRecorder:
    """The steps of one rollout.

    Args:
        trajectory_id: id reported on every step (a uuid per rollout).
        max_seq_len: context bound used for ``overlong_prompt`` / ``is_truncated``.
    """

    trajectory_id: str
    max_seq_len: int | None = None
    _steps: list[RecordedStep] = field(default_factory=list)
    #: History state before the last step (to undo an abandoned turn).
    _before_last: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        self._ids = TokenBranches(self.max_seq_len)
        self._history = MessageHistory()
        self._abandoned: list[int] = []
        #: The last recorded ``extras["tools"]``: a turn with the same tools shares it.
        self._tools: Any = None

    @property
    def num_steps(self) -> int:
        """Number of recorded turns."""
        return len(self._steps)

    @property
    def last_context_tokens(self) -> int:
        """Prompt + completion ids of the last turn (0 when it had no ids)."""
        return len(self._ids.last_ids)

    def match_history(
        self, messages: Sequence[Mapping[str, Any]], text: bytes | memoryview | None = None
    ) -> HistoryMatch:
        """How ``messages`` extend the last turn's prompt + completion: pass it to
        :meth:`record` for the turn (see :class:`~.history.MessageHistory`). ``text`` is
        ``messages`` as JSON, when the caller has it."""
        return self._history.match(messages, text)

    def shared_messages(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """How many leading ``messages`` the last turn's prompt + completion holds already.

        ``None`` when ``messages`` does not extend that history (it was rewritten).
        """
        return self._history.match(messages).shared

    def last_turn_ids(self) -> tuple[list[int], list[int], int] | None:
        """The last turn's prompt ids, completion ids, and how many messages its prompt
        plus completion hold: what a token-in upstream extends (``None``: no usable turn,
        e.g. none yet, no ids, or the last one was abandoned)."""
        if not self._steps or self._steps[-1].abandoned:
            return None
        tokens = self._steps[-1].tokens
        if tokens is None or tokens.completion_end <= tokens.prompt_end:
            return None
        held = len(self._history.messages)
        return tokens.prompt_ids.tolist(), tokens.completion_ids.tolist(), held

    def abandon_last(self) -> int | None:
        """Mark the last step abandoned (its answer reached nobody) and forget it as the
        history the next turn extends. Returns its index (``None``: nothing to abandon)."""
        if self._steps and not self._steps[-1].abandoned and self._before_last is not None:
            step = self._steps[-1]
            step.abandoned = True
            step.tokens = None  # its ids on the branch are dropped below (never served)
            history, ids = self._before_last
            self._history.restore(history)
            self._ids.restore(ids)  # drop what the abandoned step appended
            self._before_last = None
            self._abandoned.append(len(self._steps) - 1)
            return len(self._steps) - 1
        return None

    def prompt_ids_of(self, index: int) -> list[int] | None:
        """The prompt ids of step ``index`` (``None``: it has none, or was abandoned)."""
        step = self._steps[index] if 0 <= index < len(self._steps) else None
        if step is None or step.abandoned or step.tokens is None:
            return None
        return step.tokens.prompt_ids.tolist()

    @property
    def check_state(self) -> CheckState:
        """What the next turn's request is checked against now (see :class:`~.steps.CheckState`)."""
        return CheckState(self._history.sent, self._ids.prompt_text)

    @property
    def last_step(self) -> RecordedStep:
        """The step recorded last (raises ``IndexError`` when there is none)."""
        return self._steps[-1]

    def abandoned_indexes(self) -> list[int]:
        """Indexes of the steps recorded as abandoned (a copy)."""
        return list(self._abandoned)

    def replay(
        self, steps: Sequence[StepDelta], abandoned: Collection[int] = (), *, start: int = 0
    ) -> None:
        """Hold ``steps`` again (a store's copy of this rollout's steps, in order, from
        index ``start``; those whose index is in ``abandoned`` were abandoned): steps,
        branches and history come out as recording them made them. ``start`` is the
        number of steps held already (0: an empty recorder; more: catching up with steps
        another gateway recorded after these)."""
        if start != len(self._steps):
            raise ValueError(f"replay from step {start} into a recorder of {len(self._steps)}")
        for index, delta in enumerate(steps, start):
            before = (self._history.snapshot(), self._ids.snapshot())
            tokens = None
            if delta.tokens is not None:
                t = delta.tokens
                tokens = self._ids.replay(
                    t.prefix_len, t.prompt_new_ids, t.completion_ids, t.completion_logprobs,
                    t.overlong_prompt, t.is_truncated,
                )  # fmt: skip
            else:
                self._ids.reset()
            routing = delta.routed_experts if tokens is not None else None
            step = RecordedStep(
                delta.shared_messages, delta.new_messages, delta.completion, tokens,
                delta.is_truncated, delta.extras, False, routing, delta.check,
            )  # fmt: skip
            self._steps.append(step)
            shared = HistoryMatch(delta.shared_messages)
            self._history.advance(shared, delta.new_messages, delta.completion)
            if delta.check is not None:  # the recording gateway's digests: cheap checks
                self._history.resume(delta.check.messages)
                if tokens is not None:
                    self._ids.resume(delta.check.prompt_ids, tokens.prompt_end)
            self._before_last = before
            if index in abandoned:
                self.abandon_last()

    @property
    def num_abandoned(self) -> int:
        """Steps recorded as abandoned."""
        return len(self._abandoned)

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
        history: HistoryMatch | None = None,
        extras: Mapping[str, Any] | None = None,
        prompt_ids_json: IdsText | None = None,
        truncated: bool = False,
        routed_experts: dict[str, Any] | None = None,
    ) -> None:
        """Record one turn: the request's ``messages`` and the returned ``completion``.

        Token fields are kept only when ``prompt_ids``, ``completion_ids`` and
        ``completion_logprobs`` are all given and consistent; otherwise the step has
        ``tokens: null`` (still recorded). ``total_tokens`` (usage) is the fallback
        length for ``is_truncated`` when there are no ids. ``prompt_ids_json`` (the JSON
        text of the prompt's id array, see :mod:`.prompt_ids`) may stand in for
        ``prompt_ids``: only what the previous prompt's text does not hold is parsed.
        ``extras`` (turn facts, see :class:`~rollout_gateway.protocol.StepExtras`) go into
        the step's ``extras``; ``truncated`` marks the step truncated whatever its finish
        reason. ``routed_experts`` (token-in mode's router replay, aligned to the turn's
        ids by its ``start``) goes into the step's ``tokens`` when it has ids. The step
        gets ``prefix_break`` when its prompt ids do not extend the previous step's
        prompt + completion ids.
        """
        step_extras = self._step_extras(extras)
        if history is None:  # not matched by the caller
            history = self._history.match(messages)
        shared = history.shared
        if shared is None:
            step_extras["history_rewritten"] = True
            shared = 0
        new_messages = history.new_messages(messages)  # (made once: the limits counted it)
        truncated = truncated or finish_reason in TRUNCATING_FINISH_REASONS
        extras = step_extras
        previous_ids = len(self._ids.last_ids)
        before = (self._history.snapshot(), self._ids.snapshot())

        tokens = _step_ids(
            self._ids, (prompt_ids, prompt_ids_json, completion_ids, completion_logprobs),
            extras, previous_ids,
        )  # fmt: skip
        truncated = self._is_truncated(tokens, truncated, total_tokens)

        completion_list = [dict(m) for m in completion]
        routing = routed_experts if tokens is not None else None
        step = RecordedStep(
            shared, new_messages, completion_list, tokens, truncated, extras, False, routing
        )
        self._steps.append(step)
        self._history.advance(history, new_messages, completion_list)
        # What the next turn is checked against (a shared store keeps it with the step).
        step.check = self.check_state
        self._before_last = before

    def _is_truncated(
        self, tokens: StepIds | None, truncated: bool, total_tokens: int | None
    ) -> bool:
        """Whether the step is truncated: marked so, by its ids (which then say so too),
        or, with no ids (which forgets the id history), by its usage's length."""
        if tokens is not None:
            tokens.is_truncated = tokens.is_truncated or truncated
            return tokens.is_truncated
        self._ids.reset()
        if self.max_seq_len is not None and total_tokens is not None:
            return truncated or total_tokens > self.max_seq_len
        return truncated

    def _step_extras(self, extras: Mapping[str, Any] | None) -> dict[str, Any]:
        """A step's own copy of ``extras``; its ``tools``, when the previous step's were
        equal, is that step's list (one list for every turn that sent it)."""
        step_extras: dict[str, Any] = dict(extras or {})
        tools = step_extras.get("tools")
        if tools is not None:
            if tools == self._tools:
                step_extras["tools"] = self._tools
            else:
                self._tools = tools
        return step_extras

    def record_refused(self, messages: Sequence[dict[str, Any]], extras: Mapping[str, Any]) -> None:
        """Record a turn the engine refused (no sample): its prompt, no completion, no
        tokens, marked truncated. ``extras`` carries ``status`` and ``error``."""
        self.record(messages, [], extras=extras, truncated=True)

    def steps(self) -> list[TrajectoryStepBody]:
        """All steps, rebuilt in the protocol's shape (:func:`.render.full_steps`)."""
        return full_steps(self._steps, self.trajectory_id)

    def delta_steps(self) -> list[dict[str, Any]]:
        """All steps in the delta form (:func:`.render.delta_steps`)."""
        return delta_steps(self._steps, self.trajectory_id)

    def overview(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
        """Like :meth:`summary`, without rebuilding the steps (O(messages), not O(steps))."""
        kept = [s for s in self._steps if not s.abandoned]
        if not kept:
            return [], [], False
        first = kept[0].new_messages  # the first kept step extends nothing
        completion = self._history.messages[len(first) :]
        return list(first), list(completion), any(s.is_truncated for s in kept)

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
        """Bytes held by the token arrays (each branch's ids once, and the logprobs)."""
        last = self._ids.last_ids
        segments = {id(last): last}
        total = 0
        for step in self._steps:
            if step.tokens is not None:
                segments[id(step.tokens.segment)] = step.tokens.segment
                lps = step.tokens.completion_logprobs
                total += lps.buffer_info()[1] * lps.itemsize
        return total + sum(a.buffer_info()[1] * a.itemsize for a in segments.values())

    def logical_token_count(self) -> int:
        """Tokens the trajectory reports (sum over steps of prompt + completion ids)."""
        return sum(
            s.tokens.completion_end for s in self._steps if s.tokens is not None and not s.abandoned
        )


def _step_ids(
    ids: TokenBranches,
    given: tuple[
        Sequence[int] | None, IdsText | None, Sequence[int] | None, Sequence[float] | None
    ],
    extras: dict[str, Any],
    previous_ids: int,
) -> StepIds | None:
    """A turn's ids (``given``: prompt ids or their JSON text, completion ids, logprobs)
    added to the rollout's branches, when all are given and consistent (else ``None``,
    with ``extras["tokens_error"]`` saying why when something was given wrong); whether
    the prompt breaks the previous step's ``previous_ids`` ids (``prefix_break``) and
    non-finite logprobs (``nonfinite_logprobs``) go into ``extras``."""
    prompt_ids, prompt_ids_json, completion_ids, completion_logprobs = given
    have_prompt = prompt_ids is not None or prompt_ids_json is not None
    if not have_prompt or completion_ids is None or completion_logprobs is None:
        return None
    if len(completion_logprobs) != len(completion_ids):
        extras["tokens_error"] = "logprobs and token ids differ in length"
        return None
    try:
        tokens = ids.add(
            ids.prompt(prompt_ids, prompt_ids_json), completion_ids, completion_logprobs
        )
    except (TypeError, ValueError, OverflowError):
        extras["tokens_error"] = "token ids are not 32-bit integers"
        return None
    if previous_ids:
        extras["prefix_break"] = tokens.prefix_len < previous_ids
    if not math.isfinite(sum(tokens.completion_logprobs)):
        # Served as null (JSON has no NaN/inf); the turn says so.
        extras["nonfinite_logprobs"] = sum(
            1 for x in tokens.completion_logprobs if not math.isfinite(x)
        )
    return tokens


__all__ = [
    "RECORDED_MESSAGE_FIELDS",
    "TRUNCATING_FINISH_REASONS",
    "TrajectoryRecorder",
    "message_key",
    "recorded_message",
    "same_message",
]
