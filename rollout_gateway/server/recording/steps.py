"""One recorded turn, in the two forms the gateway keeps it.

:class:`RecordedStep` is a step as the recorder holds it in memory: its token ids are a
window on its branch's array (:class:`~.token_branches.StepIds`, each id stored once per
branch). :class:`StepDelta` is the same step as a store keeps it and hands it back: only
what the previous step's prompt + completion does not hold, with arrays of its own. The
recorder writes :class:`RecordedStep` and replays :class:`StepDelta`
(:meth:`~.recorder.TrajectoryRecorder.replay`); the state backends
(:mod:`rollout_gateway.server.state`) take the one and give back the other.
:class:`CheckState` is what a recorder checks the next turn against once the step is
recorded: a shared store keeps it beside the last step, so that the gateway taking the
next turn checks it as cheaply as the one that recorded the step.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from rollout_gateway.server.recording.digests import ArrayText
from rollout_gateway.server.recording.token_branches import StepIds


# Not frozen: made every turn, and a frozen dataclass's constructor costs several
# times a plain one's (issue 33).
@dataclass(slots=True)
class CheckState:
    """The digests a recorder checks the next turn's request against, right after a step
    (see :mod:`.digests`): the text of the step's request messages
    (:class:`~.history.MessageHistory`) and of its prompt's id array
    (:class:`~.token_branches.TokenBranches`), each ``None`` when there is none.

    Replayed with the step (another gateway's copy catching up), they let that copy check
    the next request by one digest pass, as the recording gateway does, instead of
    comparing every message and parsing the whole prompt's ids. Only a hint: a digest
    that does not match (another seed, a damaged value) makes the check compare the
    messages and parse the ids, as without it.
    """

    messages: ArrayText | None
    prompt_ids: ArrayText | None


@dataclass(slots=True)
class TokenDelta:
    """A step's token ids beyond what it shares with the previous step's prompt +
    completion ids (see :class:`StepDelta`)."""

    #: Leading prompt ids equal to the previous step's prompt + completion ids.
    prefix_len: int
    #: The prompt's ids after those (``array('i')``).
    prompt_new_ids: array
    #: The completion's ids (``array('i')``).
    completion_ids: array
    #: Their logprobs (``array('f')``, one per completion id).
    completion_logprobs: array
    overlong_prompt: bool
    is_truncated: bool


@dataclass(slots=True)
class StepDelta:
    """One step as stored: its messages beyond the shared ones, its tokens beyond the
    shared ones (``None``: the step has no ids), its flags and its extras."""

    #: Leading messages shared with the previous step's prompt + completion.
    shared_messages: int
    new_messages: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    tokens: TokenDelta | None
    is_truncated: bool
    extras: dict[str, Any]
    #: Token-in mode's MoE routing of the turn (``{data, shape, start, dtype}``).
    routed_experts: dict[str, Any] | None = None
    #: What the recorder checked the next turn against after this step, when the store
    #: kept it (not part of the trajectory; see :class:`CheckState`).
    check: CheckState | None = None


@dataclass(slots=True)
class RecordedStep:
    """One step as the recorder holds it (its ids are a window on a shared branch)."""

    #: Leading messages shared with the previous prompt + completion.
    shared_messages: int
    new_messages: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    tokens: StepIds | None
    is_truncated: bool
    extras: dict[str, Any]
    #: Nobody received the answer: not a turn the agent saw (never served).
    abandoned: bool = False
    #: Token-in mode's MoE routing of the turn (``{data, shape, start, dtype}``).
    routed_experts: dict[str, Any] | None = None
    #: What the recorder checked the next turn against right after this step (valid for
    #: a copy replayed up to this step; see :class:`CheckState`).
    check: CheckState | None = None

    def token_delta(self) -> TokenDelta | None:
        """The step's ids beyond the shared prefix, copied out of the branch."""
        t = self.tokens
        if t is None:
            return None
        return TokenDelta(
            t.prefix_len,
            t.segment[t.prefix_len : t.prompt_end],
            t.segment[t.prompt_end : t.completion_end],
            t.completion_logprobs,
            t.overlong_prompt,
            t.is_truncated,
        )

    def delta(self) -> StepDelta:
        """The step as a store keeps it (see :class:`StepDelta`)."""
        return StepDelta(
            self.shared_messages,
            self.new_messages,
            self.completion,
            self.token_delta(),
            self.is_truncated,
            self.extras,
            self.routed_experts,
            self.check,
        )


__all__ = ["CheckState", "RecordedStep", "StepDelta", "TokenDelta"]
