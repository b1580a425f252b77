"""The variables a v1 harness gives its program to reach the model through the gateway.

v1 hands a harness ``endpoint`` (the gateway's keyed root, ``{gateway}/v1``) and ``secret``
(the rollout's key). Each client derives its route from its own base URL variable:

- the OpenAI SDK (chat completions, Responses): ``OPENAI_BASE_URL`` = ``endpoint``
  (``{endpoint}/chat/completions``, ``{endpoint}/responses``), ``OPENAI_API_KEY`` sent as
  a Bearer token;
- the Anthropic SDK and Claude Code (Messages): ``ANTHROPIC_BASE_URL`` = ``endpoint``
  without its ``/v1`` (the SDK appends ``/v1/messages``), ``ANTHROPIC_API_KEY`` sent as
  ``x-api-key``; ``ANTHROPIC_MODEL`` is Claude Code's model.

So a harness that passes :func:`agent_environment` runs Claude Code instead of an
OpenAI-SDK agent by changing only its command. Codex reads no base URL variable: its
command names a provider (``base_url="$OPENAI_BASE_URL"``, ``env_key="OPENAI_API_KEY"``).
"""

from __future__ import annotations


def anthropic_base_url(endpoint: str) -> str:
    """The Anthropic SDK's base URL for a v1 ``endpoint`` (its ``/v1`` taken off)."""
    endpoint = endpoint.rstrip("/")
    return endpoint.removesuffix("/v1")


def agent_environment(endpoint: str, secret: str, model: str) -> dict[str, str]:
    """The OpenAI and Anthropic clients' variables for ``endpoint`` and ``secret``."""
    return {
        "OPENAI_BASE_URL": endpoint,
        "OPENAI_API_KEY": secret,
        "OPENAI_MODEL": model,
        "ANTHROPIC_BASE_URL": anthropic_base_url(endpoint),
        "ANTHROPIC_API_KEY": secret,
        "ANTHROPIC_MODEL": model,
    }


__all__ = ["agent_environment", "anthropic_base_url"]
