"""An engine's refusal of a request that does not fit its context, read from its message.

Two different faults come back as a 400 that speaks of the context length:

- **the prompt does not fit** (:data:`PROMPT`): the conversation itself is longer than
  the engine's context. Nothing the gateway can change makes it fit: the turn is recorded
  as truncated and the rollout ends, as verifiers counts it.
- **the requested completion does not fit** (:data:`COMPLETION`): the prompt fits, but
  ``max_tokens`` asks for more than the room left after it. The request was wrong, not the
  conversation: the gateway asks again once with a bound the engine states it accepts
  (:func:`retry_max_tokens`), and the rollout goes on either way.

The engines word them differently across versions; each wording below was read from the
engine's source or seen from a running server:

==========================  ======================================================  ===========
engine                      message (``W`` window, ``P`` prompt, ``C`` completion)  fault
==========================  ======================================================  ===========
vLLM 0.32                   ``max_tokens=C cannot be greater than max_model_len=W``  completion
vLLM 0.32                   ``... context length is W tokens. However, your prompt   prompt
                            contains [at least] P input tokens ...``
vLLM 0.32                   ``max_tokens must be at least 1, got 0`` (a prompt of    prompt
                            exactly W tokens: vLLM fits max_tokens to the room it
                            leaves, 0; the gateway itself never sends 0)
vLLM 0.8-0.10               ``'max_tokens' or 'max_completion_tokens' is too large:  completion
                            C. ... context length is W tokens and your request has
                            P input tokens``
vLLM 0.6-0.10               ``... context length is W tokens. However, your request  prompt
                            has P input tokens``
vLLM (some releases)        ``... context length is W tokens. However, you requested by P
                            C output tokens and your prompt contains P input tokens``
vLLM 0.4-0.6                ``... context length is W tokens. However, you requested by P
                            T tokens (P in the messages, C in the completion)``
vLLM (generate endpoints)   ``Input length (P) exceeds model's maximum context        prompt
                            length (W)``
SGLang                      ``Requested token count exceeds the model's maximum        by P
                            context length of W tokens. You requested a total of T
                            tokens: P tokens from the input messages and C tokens
                            for the completion``
SGLang                      ``The input (P tokens) is longer than the model's context  prompt
                            length (W tokens)``
SGLang (scheduler)          ``Input length (P tokens) exceeds the maximum allowed      prompt
                            length (W tokens)``
==========================  ======================================================  ===========

"by P": the prompt's fault when ``P >= W`` (nothing is left for the completion), else the
completion's. A message that speaks of the context but matches no wording is taken for
the prompt's fault, as before this module: ending a rollout the engine cannot serve is
safer than retrying a request nobody understood.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

RefusalKind = Literal["prompt", "completion"]

#: The prompt itself is longer than the engine's context.
PROMPT: Final[RefusalKind] = "prompt"
#: The prompt fits; the requested ``max_tokens`` does not fit after it.
COMPLETION: Final[RefusalKind] = "completion"

#: Any message about the context length (an engine's wording this module does not know).
_ABOUT_CONTEXT = re.compile(
    r"maximum context length|context length|context window|max_model_len|"
    r"maximum model length|prompt is too long",
    re.IGNORECASE,
)

#: (pattern, fault: PROMPT, COMPLETION or None for "by the numbers"). Groups are named
#: ``window``, ``prompt`` and ``completion``.
_WORDINGS: tuple[tuple[re.Pattern[str], RefusalKind | None], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE | re.DOTALL), kind)
    for pattern, kind in (
        (
            r"max_(?:completion_)?tokens=(?P<completion>\d+) cannot be greater than "
            r"max_model_len=(?P<window>\d+)",
            COMPLETION,
        ),
        (
            r"'max_tokens' or 'max_completion_tokens' is too large: (?P<completion>\d+).*?"
            r"context length is (?P<window>\d+) tokens and your request has "
            r"(?P<prompt>\d+) input tokens",
            COMPLETION,
        ),
        (
            r"context length is (?P<window>\d+) tokens\. However, you requested "
            r"(?P<completion>\d+) output tokens and your prompt contains (?:at least )?"
            r"(?P<prompt>\d+) input tokens",
            None,
        ),
        (
            r"context length is (?P<window>\d+) tokens\. However, you requested \d+ tokens "
            r"\((?P<prompt>\d+) in the messages, (?P<completion>\d+) in the completion\)",
            None,
        ),
        (
            r"context length is (?P<window>\d+) tokens\. However, your (?:prompt contains|"
            r"request has) (?:at least )?(?P<prompt>\d+) input tokens",
            PROMPT,
        ),
        (
            r"Input length \((?P<prompt>\d+)\) exceeds model's maximum context length "
            r"\((?P<window>\d+)\)",
            PROMPT,
        ),
        (
            r"maximum context length of (?P<window>\d+) tokens\. You requested a total of "
            r"\d+ tokens: (?P<prompt>\d+) tokens from the input messages and "
            r"(?P<completion>\d+) tokens for the completion",
            None,
        ),
        (r"max_(?:completion_)?tokens must be at least 1, got 0", PROMPT),
        (
            r"The input \((?P<prompt>\d+) tokens\) is longer than the model's context "
            r"length \((?P<window>\d+) tokens\)",
            PROMPT,
        ),
        (
            r"Input length \((?P<prompt>\d+) tokens\) exceeds the maximum allowed length "
            r"\((?P<window>\d+) tokens\)",
            PROMPT,
        ),
    )
)


@dataclass(frozen=True)
class ContextRefusal:
    """What an engine's context refusal says (each count ``None`` where it does not say)."""

    kind: RefusalKind
    #: The engine's context length (``max_model_len``).
    window: int | None = None
    #: The prompt's tokens as the engine counted them.
    prompt_tokens: int | None = None
    #: The completion tokens the request asked for.
    completion_tokens: int | None = None


def _count(match: re.Match[str], name: str) -> int | None:
    value = match.groupdict().get(name)
    return int(value) if value else None


def read_context_refusal(message: str) -> ContextRefusal | None:
    """The context refusal an engine's 400 ``message`` states, else ``None``."""
    for pattern, kind in _WORDINGS:
        match = pattern.search(message)
        if match is None:
            continue
        window, prompt = _count(match, "window"), _count(match, "prompt")
        if kind is None:  # by the numbers: does anything remain for the completion?
            kind = PROMPT if window is None or prompt is None or prompt >= window else COMPLETION
        return ContextRefusal(kind, window, prompt, _count(match, "completion"))
    if _ABOUT_CONTEXT.search(message):
        return ContextRefusal(PROMPT)
    return None


def retry_max_tokens(refusal: ContextRefusal, *, sent: int) -> int | None:
    """The ``max_tokens`` to ask again with after a :data:`COMPLETION` refusal of ``sent``:
    the room the engine states it has (its window less the prompt it counted; its window
    alone where it does not count the prompt, as vLLM 0.32, which fits a ``max_tokens``
    up to its window to the room the prompt leaves). ``None`` when nothing smaller than
    ``sent`` can be asked: the refusal then goes to the agent.
    """
    if refusal.kind != COMPLETION or refusal.window is None:
        return None
    room = refusal.window - (refusal.prompt_tokens or 0)
    return room if 0 < room < sent else None


__all__ = [
    "COMPLETION",
    "PROMPT",
    "ContextRefusal",
    "RefusalKind",
    "read_context_refusal",
    "retry_max_tokens",
]
