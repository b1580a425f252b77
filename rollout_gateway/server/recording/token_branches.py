"""The token ids of one rollout's turns, each id stored once per branch.

A turn's prompt usually extends the previous turn's prompt + completion: the ids are kept
in one ``array('i')`` per branch (4 bytes per id), and a step is a few offsets into it.
A turn whose prompt does not extend the branch (a rewritten history) starts a new one.
The prompt may come as the engine's JSON text of its id array (see :mod:`.prompt_ids`):
only what the previous prompt's text does not hold is parsed, after a digest check of the
shared part. :class:`~.recorder.TrajectoryRecorder` keeps one :class:`TokenBranches`.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from rollout_gateway.protocol import common_prefix_len
from rollout_gateway.server.recording.digests import ArrayText, shared_elements
from rollout_gateway.server.recording.prompt_ids import IdsText


def int32_array(values: Sequence[int]) -> array:
    """``array("i", values)``, the same array or the same error (``TypeError``,
    ``OverflowError``), but packed in one C call when ``values`` is a list of ints: the
    array's own conversion parses each item as a call's argument (about three times the
    instructions, every new id of every turn)."""
    if type(values) is list:
        try:
            return array("i", struct.pack(f"{len(values)}i", *values))
        except struct.error:
            pass  # not all 32-bit ints: the array's own conversion says why
    return array("i", values)


def float32_array(values: Sequence[float]) -> array:
    """``array("f", values)``, the same array or the same error, packed in one C call
    when ``values`` is a list (see :func:`int32_array`; a finite value beyond float32's
    range, which the array stores as an infinity, takes the array's own conversion)."""
    if type(values) is list:
        try:
            return array("f", struct.pack(f"{len(values)}f", *values))
        except (struct.error, OverflowError):
            pass
    return array("f", values)


#: What :meth:`TokenBranches.snapshot` saves: the branch, its length, the prompt text state.
BranchSnapshot = tuple[array, int, "ArrayText | None"]


@dataclass(slots=True)
class StepIds:
    """One turn's ids: ``segment[:prompt_end]`` is the prompt,
    ``segment[prompt_end:completion_end]`` the completion. Steps that extend their
    predecessor share its segment (appended to in place), so each id is stored once."""

    segment: array
    prefix_len: int  # leading ids shared with the previous step's prompt+completion
    prompt_end: int
    completion_end: int
    completion_logprobs: array
    overlong_prompt: bool
    is_truncated: bool

    @property
    def prompt_ids(self) -> array:
        """The prompt's ids (a copy)."""
        return self.segment[: self.prompt_end]

    @property
    def completion_ids(self) -> array:
        """The completion's ids (a copy)."""
        return self.segment[self.prompt_end : self.completion_end]


@dataclass(slots=True)
class PromptIds:
    """A turn's prompt ids, as :meth:`TokenBranches.prompt` read them: the first
    ``known`` ids of ``branch`` (known equal without comparing them), then ``tail``."""

    branch: array
    known: int
    tail: array

    def __len__(self) -> int:
        return self.known + len(self.tail)


class TokenBranches:
    """The current branch of ids and what the next turn's prompt is checked against.

    Args:
        max_seq_len: context bound used for ``overlong_prompt`` / ``is_truncated``.
    """

    def __init__(self, max_seq_len: int | None = None) -> None:
        self.max_seq_len = max_seq_len
        #: The last turn's prompt + completion ids (the branch the next turn extends).
        self.last_ids = array("i")
        #: The last prompt's id-array text, as (digest without "]", its length, id count).
        self._last_prompt_text: ArrayText | None = None

    def snapshot(self) -> BranchSnapshot:
        """What :meth:`restore` needs to undo the next turn."""
        return self.last_ids, len(self.last_ids), self._last_prompt_text

    def restore(self, snapshot: BranchSnapshot) -> None:
        """Undo the turns since ``snapshot`` (their ids appended to the branch are dropped)."""
        self.last_ids, length, self._last_prompt_text = snapshot
        del self.last_ids[length:]

    @property
    def prompt_text(self) -> ArrayText | None:
        """The last prompt's id-array text state (``None``: the next prompt is parsed whole)."""
        return self._last_prompt_text

    def resume(self, text: ArrayText | None, prompt_len: int) -> None:
        """Check the next prompt's text against ``text``: the last prompt's, as the
        gateway that recorded it had it (a copy replayed up to that step, whose prompt
        is the branch's first ``prompt_len`` ids). Ignored unless it counts those ids."""
        if text is not None and text[2] == prompt_len <= len(self.last_ids):
            self._last_prompt_text = text

    def reset(self) -> None:
        """The last turn had no ids: the next one starts a new branch."""
        self.last_ids = array("i")
        self._last_prompt_text = None

    def prompt(self, ids: Sequence[int] | None, text: IdsText | None) -> PromptIds:
        """The prompt's ids, from ``text`` (JSON array) when given, else from ``ids``.

        Raises ``TypeError`` / ``ValueError`` / ``OverflowError`` for ids that are not
        32-bit integers.
        """
        if text is None:
            self._last_prompt_text = None
            return PromptIds(self.last_ids, 0, int32_array(ids))  # type: ignore[arg-type]
        last = self._last_prompt_text
        known, digest, length = shared_elements(text, last)
        if known:
            assert last is not None
            end = last[1]  # where the known ids' text ends: "," before new ids, or "]"
            tail = array("i")
            if text[end : end + 1] == b",":
                tail = int32_array(orjson.loads(b"[" + text[end + 1 :]))
            prompt = PromptIds(self.last_ids, known, tail)
        else:
            prompt = PromptIds(self.last_ids, 0, int32_array(orjson.loads(text)))
        self._last_prompt_text = (digest, length, len(prompt))
        return prompt

    def add(
        self, prompt: PromptIds, completion_ids: Sequence[int], logprobs: Sequence[float]
    ) -> StepIds:
        """Store one turn's ids on the branch its prompt extends (or a new one)."""
        comp = int32_array(completion_ids)
        lps = float32_array(logprobs)
        last = self.last_ids
        known = prompt.known if prompt.branch is last else 0
        tail = prompt.tail
        # Only what follows the ids known to be the branch's (usually the previous
        # completion, as the engine tokenized it again) is compared.
        prefix = known + common_prefix_len(last[known:] if known else last, tail)
        prompt_len = known + len(tail)
        overlong = self.max_seq_len is not None and prompt_len > self.max_seq_len
        too_long = self.max_seq_len is not None and prompt_len + len(comp) > self.max_seq_len
        if last and prefix == len(last):
            segment = last  # the prompt extends the branch: append in place
            segment.extend(tail[prefix - known :])
        elif known:
            segment = last[:known]  # a new branch that starts with the branch's first ids
            segment.extend(tail)
        else:
            segment = tail  # a new branch (first turn, or a rewritten history)
        prompt_end = len(segment)
        segment.extend(comp)
        self.last_ids = segment  # the next turn's prompt usually extends this
        return StepIds(segment, prefix, prompt_end, len(segment), lps, overlong, too_long)

    def replay(
        self,
        prefix_len: int,
        prompt_new_ids: array,
        completion_ids: array,
        logprobs: array,
        overlong_prompt: bool,
        is_truncated: bool,
    ) -> StepIds:
        """Store a recorded step again from its delta (a store's copy): its prompt is the
        branch's first ``prefix_len`` ids, then ``prompt_new_ids``; the branches come out
        as :meth:`add` made them."""
        last = self.last_ids
        if prefix_len > len(last):
            raise ValueError(f"a step shares {prefix_len} ids with a branch of {len(last)}")
        if last and prefix_len == len(last):
            segment = last  # it extended the branch in place
        else:
            segment = last[:prefix_len]
        segment.extend(prompt_new_ids)
        prompt_end = len(segment)
        segment.extend(completion_ids)
        self.last_ids = segment
        self._last_prompt_text = None  # unknown here: parsed whole next (unless resumed)
        return StepIds(
            segment, prefix_len, prompt_end, len(segment), logprobs, overlong_prompt, is_truncated
        )


__all__ = [
    "BranchSnapshot",
    "PromptIds",
    "StepIds",
    "TokenBranches",
    "float32_array",
    "int32_array",
]
