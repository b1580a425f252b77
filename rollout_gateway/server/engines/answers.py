"""Reading an engine's chat answer: token ids, logprobs and turn facts, vLLM or SGLang.

The two engines put the training data in different places:

* vLLM (``return_token_ids: true``): top-level ``prompt_token_ids``, the choice's
  ``token_ids`` (sampled ids, the stop token included), ``stop_reason``, and the
  per-token logprobs in ``choices[].logprobs.content[].logprob``.
* SGLang (``return_prompt_token_ids`` / ``return_token_ids`` / ``return_meta_info``):
  ``prompt_token_ids`` on the *choice*, the sampled ids as the choice's ``token_ids``
  (some builds name the field ``response_token_ids``) or inside
  ``choices[].meta_info.output_token_logprobs`` (entries ``[logprob, token_id, text]``),
  ``matched_stop`` for the stop hit, and the weights' version in
  ``metadata.weight_version``.

Every choice is read (an ``n > 1`` answer keeps all its samples).

An answer whose shape the gateway cannot take for a chat completion raises
:class:`MalformedAnswer` before anything is recorded (the turn is then a 502, the
upstream's fault): no choices, a choice or its message that is not an object, content
that is not text (or a list of parts), tool calls that are not a list of objects with a
function's name and arguments as text, a finish reason that is not text. Token fields
that do not read as ids and logprobs are kept out of the step instead (``tokens: null``
with ``tokens_error`` or ``tokens_missing``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import orjson

from rollout_gateway.server.engines.upstream_request import assistant_message
from rollout_gateway.server.recording.recorder import TRUNCATING_FINISH_REASONS

#: Logprobs at or below this are sentinels, not probabilities (vLLM uses ``-9999.0``
#: for tokens whose logprob it could not compute; a float32 ``-inf`` also lands here).
SENTINEL_LOGPROB = -9000.0


# Not frozen: made every turn, and a frozen dataclass's constructor costs several
# times a plain one's (issue 33).
@dataclass(slots=True)
class ChoiceSample:
    """One sampled choice of an answer."""

    index: int
    message: dict[str, Any]
    finish_reason: str | None
    stop_reason: int | str | None
    completion_ids: list[int] | None
    completion_logprobs: list[float] | None
    #: Positions of sentinel / non-finite logprobs.
    sentinels: list[int] = field(default_factory=list)

    @property
    def is_truncated(self) -> bool:
        """Whether the finish reason says the sample was cut."""
        return self.finish_reason in TRUNCATING_FINISH_REASONS


# Not frozen: made every turn, and a frozen dataclass's constructor costs several
# times a plain one's (issue 33).
@dataclass(slots=True)
class EngineAnswer:
    """What the gateway records from one answer."""

    prompt_ids: list[int] | None
    choices: list[ChoiceSample]
    usage: dict[str, Any] | None
    cached_tokens: int | None
    weight_version: str | None
    #: The prompt's ids as JSON text, when the answer carries them so (a streamed
    #: answer's: :mod:`.streaming`); the recorder reads only what is new of it.
    prompt_ids_json: bytes | None = None

    @property
    def first(self) -> ChoiceSample | None:
        """Choice 0 (the recorded sample), if any."""
        return self.choices[0] if self.choices else None

    @property
    def has_token_ids(self) -> bool:
        """Whether the engine sent prompt and completion ids."""
        first = self.first
        if (self.prompt_ids is None and self.prompt_ids_json is None) or first is None:
            return False
        return first.completion_ids is not None


class MalformedAnswer(ValueError):
    """An engine answer the gateway cannot read as a chat completion (see the module
    docstring); its message says what is wrong."""


def _check_message(message: Any, where: str) -> dict[str, Any]:
    # dict, not Mapping: parsed JSON objects are dicts (and isinstance on an ABC is a
    # Python-level check, the largest cost of reading a turn's answer).
    if not isinstance(message, dict):
        raise MalformedAnswer(f"{where}.message is not an object")
    role = message.get("role")
    if role is not None and not isinstance(role, str):
        raise MalformedAnswer(f"{where}.message.role is not text")
    for key in ("content", "reasoning", "reasoning_content"):
        value = message.get(key)
        if value is not None and not isinstance(value, str | list):
            raise MalformedAnswer(f"{where}.message.{key} is not text")
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if not isinstance(calls, list):
        raise MalformedAnswer(f"{where}.message.tool_calls is not a list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise MalformedAnswer(f"{where}.message.tool_calls holds a call without a function")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str | None):
            raise MalformedAnswer(f"{where}.message.tool_calls: a function's name or arguments")
    return message


def _int_list(value: Any) -> list[int] | None:
    # Element types are checked by the recorder's array('i') conversion (in C).
    return value if isinstance(value, list) else None


_LOGPROB = itemgetter("logprob")


def _content_logprobs(choice: Mapping[str, Any]) -> list[float] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("content"), list):
        return None
    try:
        # Two C loops, not a Python one (the same values, or the same errors).
        return list(map(float, map(_LOGPROB, lp["content"])))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def _meta_output(choice: Mapping[str, Any]) -> tuple[list[int] | None, list[float] | None]:
    """Ids and logprobs from SGLang's ``meta_info.output_token_logprobs``."""
    meta = choice.get("meta_info")
    entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list):
        return None, None
    ids: list[int] = []
    logprobs: list[float] = []
    try:
        for entry in entries:
            logprobs.append(float(entry[0]) if entry[0] is not None else float("nan"))
            ids.append(entry[1])
    except (IndexError, KeyError, TypeError, ValueError, OverflowError):
        return None, None
    return ids, logprobs


def _sentinels(logprobs: Sequence[float] | None) -> list[int]:
    if not logprobs:
        return []
    # The usual answer has none: say so in two C loops (a NaN or an infinity makes the
    # sum non-finite and takes the exact path below, as does an overflowing sum).
    if math.isfinite(sum(logprobs)) and min(logprobs) > SENTINEL_LOGPROB:
        return []
    return [i for i, v in enumerate(logprobs) if not (v > SENTINEL_LOGPROB and math.isfinite(v))]


def _message(message: Any) -> dict[str, Any]:
    return assistant_message(message if isinstance(message, dict) else {})


def read_choice(choice: Mapping[str, Any], position: int) -> ChoiceSample:
    """One choice of an answer, in either engine's shape (raises
    :class:`MalformedAnswer`)."""
    where = f"choices[{position}]"
    message = _check_message(choice.get("message"), where)
    finish_reason = choice.get("finish_reason")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise MalformedAnswer(f"{where}.finish_reason is not text")
    ids = _int_list(choice.get("token_ids"))
    if ids is None:
        ids = _int_list(choice.get("response_token_ids"))
    logprobs = _content_logprobs(choice)
    meta_ids, meta_logprobs = _meta_output(choice)
    if ids is None:
        ids = meta_ids
    if logprobs is None:
        logprobs = meta_logprobs
    stop = choice.get("stop_reason")
    if stop is None:
        stop = choice.get("matched_stop")
    index = choice.get("index")
    return ChoiceSample(
        index=index if isinstance(index, int) and not isinstance(index, bool) else position,
        message=_message(message),
        finish_reason=finish_reason,
        stop_reason=stop if isinstance(stop, int | str) else None,
        completion_ids=ids,
        completion_logprobs=logprobs,
        sentinels=_sentinels(logprobs),
    )


def _cached_tokens(usage: Any, choices: Sequence[Any]) -> int | None:
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return details["cached_tokens"]
    for choice in choices:  # SGLang: meta_info.cached_tokens
        meta = choice.get("meta_info") if isinstance(choice, dict) else None
        if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
            return meta["cached_tokens"]
    return None


def read_answer(completion: Mapping[str, Any]) -> EngineAnswer:
    """Read a (non-streamed or reassembled) chat completion from vLLM or SGLang (raises
    :class:`MalformedAnswer`)."""
    raw_choices = completion.get("choices")
    if not isinstance(raw_choices, list) or not raw_choices:
        raise MalformedAnswer("no choices")
    for i, choice in enumerate(raw_choices):
        if not isinstance(choice, dict):
            raise MalformedAnswer(f"choices[{i}] is not an object")
    choices = [read_choice(c, i) for i, c in enumerate(raw_choices)]
    top_ids = completion.get("prompt_token_ids")
    prompt_ids = _int_list(top_ids)
    if prompt_ids is None and raw_choices:  # SGLang: on the choice
        prompt_ids = _int_list(raw_choices[0].get("prompt_token_ids"))
    # A streamed answer's ids as text (streaming.StreamedCompletion): read from that.
    ids_text = getattr(completion, "prompt_ids_json", None)
    usage = completion.get("usage")
    metadata = completion.get("metadata")
    version = metadata.get("weight_version") if isinstance(metadata, dict) else None
    return EngineAnswer(
        prompt_ids=prompt_ids,
        choices=choices,
        usage=dict(usage) if isinstance(usage, dict) else None,
        cached_tokens=_cached_tokens(usage, raw_choices),
        weight_version=str(version) if version is not None else None,
        prompt_ids_json=ids_text if isinstance(top_ids, orjson.Fragment) else None,
    )


__all__ = [
    "SENTINEL_LOGPROB",
    "MalformedAnswer",
    "ChoiceSample",
    "EngineAnswer",
    "read_answer",
    "read_choice",
]
