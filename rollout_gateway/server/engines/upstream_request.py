"""One chat turn: the request sent upstream, and the answer as the agent sees it.

Reading the engine's answer (token ids, logprobs, finish facts) is :mod:`.answers`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

import orjson

from rollout_gateway import protocol

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


def drop_unread_values(body: dict[str, Any]) -> None:
    """Set to ``None`` the values of every field of an agent's request the gateway never
    reads (see :func:`dropped_field_facts`, which still lists their names).

    The parsed body lives until the turn is answered, behind a slow engine perhaps; a
    ``pad`` of millions of values would live as long, for nothing.
    """
    for key in body:
        if key not in _KEPT_FIELDS:
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


def flatten_sampling_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Registered sampling params as top-level request fields.

    verifiers passes engine-specific parameters (``top_k``, ``min_p``...) under
    ``extra_body``; the OpenAI SDK would merge that into the body, so do the same, with
    the precedence every side uses (:func:`protocol.flatten_sampling_args`).
    """
    return protocol.flatten_sampling_args(params)


def build_upstream_request(
    body: Mapping[str, Any],
    *,
    model: str,
    sampling_params: Mapping[str, Any],
    max_tokens_bound: int | None = None,
    messages_text: bytes | None = None,
) -> dict[str, Any]:
    """The upstream request for an agent's chat ``body``.

    An allowlist: only :data:`AGENT_FORWARDED_FIELDS` of the agent's body are forwarded;
    every other field (sampling, ``n``, ``seed``, ``logit_bias``, ``echo``, engine
    extras...) is dropped (see :func:`dropped_field_facts`). The registered ``model``
    and ``sampling_params`` are sent as registered. ``max_tokens`` is the registered value,
    else the agent's ``max_tokens`` / ``max_completion_tokens``, capped by
    ``max_tokens_bound`` (the rollout's remaining budget). The call is never streamed and
    always asks for token ids and logprobs (vLLM's ``return_token_ids`` / ``logprobs``).
    ``messages_text`` (``body["messages"]`` as :func:`orjson.dumps` writes it) is sent as
    it is, not written again.
    """
    registered = flatten_sampling_params(sampling_params)
    request = {k: body[k] for k in AGENT_FORWARDED_FIELDS if k in body}
    if messages_text is not None and "messages" in request:
        request["messages"] = orjson.Fragment(messages_text)
    max_tokens = _first_set(registered, _MAX_TOKEN_KEYS)
    if max_tokens is None:
        max_tokens = _first_set(body, _MAX_TOKEN_KEYS)
    if max_tokens_bound is not None:
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
            max_tokens = min(max_tokens, max_tokens_bound)
        else:
            max_tokens = max_tokens_bound
    request.update({k: v for k, v in registered.items() if k not in _MAX_TOKEN_KEYS})
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    request["model"] = model
    request["stream"] = False
    request["return_token_ids"] = True
    request["logprobs"] = True
    return request


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
    "AGENT_READ_FIELDS",
    "NOT_REGISTRABLE_FIELDS",
    "agent_view",
    "assistant_message",
    "build_upstream_request",
    "drop_unread_values",
    "MAX_DROPPED_FIELDS",
    "MAX_DROPPED_FIELD_CHARS",
    "dropped_field_facts",
    "flatten_sampling_params",
]
