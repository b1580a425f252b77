"""One chat turn: the request sent upstream, and the answer as the agent sees it.

Reading the engine's answer (token ids, logprobs, finish facts) is :mod:`.answers`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

import orjson

from rollout_gateway import protocol
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.responses import ApiError

_MAX_TOKEN_KEYS = ("max_tokens", "max_completion_tokens")

#: Request fields an agent may set that are forwarded to the engine. They shape the
#: conversation, not the sampling distribution. Registered sampling params still win.
AGENT_FORWARDED_FIELDS = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "stop",
)
#: Request fields an agent may set that the gateway reads but does not forward as sent:
#: ``max_tokens`` / ``max_completion_tokens`` apply only when registration sets none;
#: ``stream``, ``stream_options``, ``logprobs``, ``return_token_ids`` only shape the
#: agent's answer (upstream is always asked for ids and logprobs); ``model`` is replaced
#: by the registered model; ``top_logprobs`` is accepted and ignored (upstream is never
#: asked for alternatives: answers carry the sampled tokens' logprobs only).
AGENT_READ_FIELDS = (
    *_MAX_TOKEN_KEYS,
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "model",
)
_AGENT_FIELDS = frozenset((*AGENT_FORWARDED_FIELDS, *AGENT_READ_FIELDS))
#: Fields whose values the gateway reads (forwarded, read, or shaping the answer).
_KEPT_FIELDS = _AGENT_FIELDS | {"include_reasoning"}


#: The agent's own request fields that are sampling settings, recorded as it sent them
#: (``extras.agent_sampling``) beside what the gateway sent (``extras.sampling``). Its
#: ``stop`` is forwarded, so ``extras.sampling`` holds it already.
AGENT_SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "max_completion_tokens",
        "reasoning_effort",
        "seed",
        "n",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }
)
#: A string value the agent sends (``reasoning_effort``) is kept up to this many characters:
#: the step keeps it for the rollout's life.
_MAX_AGENT_SAMPLING_CHARS = 64


def drop_unread_values(body: dict[str, Any]) -> None:
    """Set to ``None`` the values of every field of an agent's request the gateway never
    reads (see :func:`dropped_field_facts`, which still lists their names), but for the
    sampling settings it records as the agent sent them (:func:`agent_sampling`).

    The parsed body lives until the turn is answered, behind a slow engine perhaps; a
    ``pad`` of millions of values would live as long, for nothing.
    """
    for key, value in body.items():
        if key in _KEPT_FIELDS:
            continue
        if key not in AGENT_SAMPLING_FIELDS or not isinstance(value, bool | int | float | str):
            body[key] = None


#: A turn records at most this many names of dropped fields, each cut to this many
#: characters: the agent chooses them (a 16 MiB body holds a million names) and the step
#: keeps them for the rollout's life, outside its stored-message budget.
MAX_DROPPED_FIELDS = 32
MAX_DROPPED_FIELD_CHARS = 64


def dropped_field_facts(body: Mapping[str, Any]) -> dict[str, Any]:
    """The turn's ``extras`` about the fields of an agent's request the gateway drops
    (every sampling field, ``n``, ``seed``, ``logit_bias``, engine extras...):
    ``dropped_fields`` (sorted names, at most :data:`MAX_DROPPED_FIELDS`, each at most
    :data:`MAX_DROPPED_FIELD_CHARS` characters) and ``dropped_fields_omitted`` (how many
    more), when there are any."""
    names = [k for k in body if k not in _AGENT_FIELDS]
    if not names:
        return {}
    kept = heapq.nsmallest(MAX_DROPPED_FIELDS, names)
    facts: dict[str, Any] = {"dropped_fields": [n[:MAX_DROPPED_FIELD_CHARS] for n in kept]}
    if len(names) > len(kept):
        facts["dropped_fields_omitted"] = len(names) - len(kept)
    return facts


#: Request fields a registration's ``sampling_params`` may not set: the conversation is
#: the agent's (a registered ``messages`` would replace every turn's prompt).
NOT_REGISTRABLE_FIELDS = ("messages", "prompt")


class FlatSampling(dict[str, Any]):
    """Sampling params flattened already (:func:`flatten_sampling_params`): flattening
    them again returns them as they are. A rollout's registered params are flattened
    once (:attr:`~rollout_gateway.server.state.registry.RolloutRecord.flat_sampling`),
    not three times a turn. Shared: read, never changed."""


def flatten_sampling_params(params: Mapping[str, Any]) -> FlatSampling:
    """Registered sampling params as top-level request fields.

    verifiers passes engine-specific parameters (``top_k``, ``min_p``...) under
    ``extra_body``; the OpenAI SDK would merge that into the body, so do the same, with
    the precedence every side uses (:func:`protocol.flatten_sampling_args`).
    """
    if isinstance(params, FlatSampling):
        return params
    return FlatSampling(protocol.flatten_sampling_args(params))


def validate_max_tokens(body: Mapping[str, Any]) -> None:
    """Raise a 400 for an agent's ``max_tokens`` / ``max_completion_tokens`` that is not a
    positive integer or ``null`` (an engine would refuse it anyway, and vLLM's refusal of
    ``0`` reads like a prompt that fills its whole context)."""
    for key in _MAX_TOKEN_KEYS:
        value = body.get(key)
        positive = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if value is not None and not positive:
            raise ApiError(
                400, f"'{key}' must be a positive integer or null", "invalid_request_error"
            )


def requested_max_tokens(body: Mapping[str, Any], sampling_params: Mapping[str, Any]) -> int | None:
    """The completion bound asked for this turn: the registered ``max_tokens`` (or
    ``max_completion_tokens``), else the agent's (checked: :func:`validate_max_tokens`);
    ``None`` when neither sets one."""
    asked = _first_set(flatten_sampling_params(sampling_params), _MAX_TOKEN_KEYS)
    if asked is None:
        asked = _first_set(body, _MAX_TOKEN_KEYS)
    return asked if isinstance(asked, int) and not isinstance(asked, bool) else None


def max_tokens_to_send(asked: int | None, budget: int | None, window: int | None) -> int | None:
    """The ``max_tokens`` a turn sends upstream (``None``: send none).

    Never more than the engine can give, never less than was asked within the rollout's
    limits:

    - ``asked`` (:func:`requested_max_tokens`) is sent, lowered to ``budget`` (what the
      rollout's own budgets leave, :func:`~rollout_gateway.server.agents.limits.budget_bound`)
      and to ``window`` (the engine's context, ``max_model_len``): vLLM refuses a
      ``max_tokens`` over its context and fits a smaller one to the room the prompt
      leaves; an engine that refuses it (SGLang) says how many tokens the prompt has, and
      the turn asks again with that room (:mod:`.context_refusal`).
    - Nothing asked: the budget is sent where it is smaller than the engine's context
      (or the context is unknown); else nothing, and the engine gives what its context
      leaves after the prompt.
    """
    bound = budget
    if asked is not None:
        bound = asked if bound is None else min(asked, bound)
    elif bound is not None and window is not None and bound >= window:
        return None
    if bound is not None and window is not None:
        bound = min(bound, window)
    return None if bound is None else max(1, bound)


def build_upstream_request(
    body: Mapping[str, Any],
    *,
    model: str,
    sampling_params: Mapping[str, Any],
    max_tokens: int | None = None,
    messages_text: bytes | memoryview | None = None,
) -> dict[str, Any]:
    """The upstream request for an agent's chat ``body``.

    An allowlist: only :data:`AGENT_FORWARDED_FIELDS` of the agent's body are forwarded;
    every other field (sampling, ``n``, ``seed``, ``logit_bias``, ``echo``, engine
    extras...) is dropped (see :func:`dropped_field_facts`). The registered ``model``
    and ``sampling_params`` are sent as registered, but for their ``max_tokens``:
    ``max_tokens`` is sent as given (:func:`max_tokens_to_send`; ``None``: none). The
    call is never streamed and always asks for token ids and logprobs (vLLM's
    ``return_token_ids`` / ``logprobs``). ``messages_text`` (``body["messages"]`` as
    :func:`orjson.dumps` writes it; a view of it too) is sent as it is, not written again.
    """
    registered = flatten_sampling_params(sampling_params)
    request = {k: body[k] for k in AGENT_FORWARDED_FIELDS if k in body}
    if messages_text is not None and "messages" in request:
        if type(messages_text) is bytes:
            request["messages"] = orjson.Fragment(messages_text)
        else:  # a view: written around (jsonio.dumps_request), not copied out first
            request["messages"] = jsonio.SplicedText(memoryview(messages_text))
    request.update({k: v for k, v in registered.items() if k not in _MAX_TOKEN_KEYS})
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    request["model"] = model
    request["stream"] = False
    request["return_token_ids"] = True
    request["logprobs"] = True
    return request


def agent_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields of the agent's request as it sent them: numbers, booleans
    and short strings (``null`` and other values left out). A turn records them as
    ``extras.agent_sampling``: what the agent asked for, beside ``extras.sampling``,
    what went upstream."""
    out: dict[str, Any] = {}
    for key in AGENT_SAMPLING_FIELDS.intersection(body):
        value = body[key]
        if isinstance(value, bool | int | float):
            out[key] = value
        elif isinstance(value, str):
            out[key] = value[:_MAX_AGENT_SAMPLING_CHARS]
    return out


def _first_set(mapping: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if mapping.get(key) is not None:
            return mapping[key]
    return None


_MESSAGE_FIELDS = ("role", "content", "tool_calls", "reasoning_content", "name")


def assistant_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message as recorded: OpenAI fields only, empty extras dropped.

    Reasoning text is recorded under both names engines use: ``reasoning`` (vLLM >= 0.10)
    and ``reasoning_content`` (SGLang, older vLLM, most chat templates).
    """
    out: dict[str, Any] = {"role": message.get("role") or "assistant"}
    out["content"] = message.get("content")
    for key in _MESSAGE_FIELDS[2:]:
        if message.get(key):
            out[key] = message[key]
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def agent_view(completion: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """The answer as the agent asked for it: token fields only if it asked for them.

    The gateway always asks upstream for ids and logprobs; echoing a long context's
    ``prompt_token_ids`` back to an agent that did not ask would waste the tunnel.
    """
    if body.get("return_token_ids") and body.get("logprobs"):
        return completion
    out = dict(completion)
    if not body.get("return_token_ids"):
        out.pop("prompt_token_ids", None)
    choices = []
    for choice in out.get("choices") or []:
        if isinstance(choice, dict):
            choice = dict(choice)
            if not body.get("return_token_ids"):
                choice.pop("token_ids", None)
            if not body.get("logprobs"):
                choice["logprobs"] = None
        choices.append(choice)
    out["choices"] = choices
    return out


__all__ = [
    "AGENT_FORWARDED_FIELDS",
    "AGENT_SAMPLING_FIELDS",
    "AGENT_READ_FIELDS",
    "NOT_REGISTRABLE_FIELDS",
    "agent_sampling",
    "agent_view",
    "assistant_message",
    "build_upstream_request",
    "FlatSampling",
    "drop_unread_values",
    "MAX_DROPPED_FIELDS",
    "MAX_DROPPED_FIELD_CHARS",
    "dropped_field_facts",
    "flatten_sampling_params",
    "max_tokens_to_send",
    "requested_max_tokens",
    "validate_max_tokens",
]
