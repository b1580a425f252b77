"""What each official client sends when configured from an agent's environment alone:
the OpenAI SDK (chat completions, Responses) and the Anthropic SDK (Messages), as a
sandboxed agent's SDK configures itself from ``OPENAI_*`` / ``ANTHROPIC_*``. Shared by
the classic and v1 tests of the agent's variables."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import anthropic
import openai

#: The OpenAI and Anthropic pairs, with the model names our agent and Claude Code read.
CLIENT_VARS = (
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_MODEL",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_MODEL",
)


def _http_library(sdk: str) -> Any:
    """The HTTP library an SDK version is built on (``httpx2`` in the newest, else httpx)."""
    base = importlib.import_module(f"{sdk}._base_client")
    return getattr(base, "httpx2", None) or base.httpx


def _recording_client(sdk: str, seen: list[Any]) -> Any:
    http = _http_library(sdk)

    def answer(request: Any) -> Any:
        seen.append(request)
        return http.Response(404, json={"error": {"message": "seen", "type": "not_found"}})

    return http.Client(transport=http.MockTransport(answer))


def sent_by_each_client(env: dict[str, str]) -> list[Any]:
    """The requests of one call of each client, in order: chat, Responses, Messages
    (each answered 404)."""
    seen: list[Any] = []
    oa = openai.OpenAI(
        base_url=env["OPENAI_BASE_URL"],
        api_key=env["OPENAI_API_KEY"],
        http_client=_recording_client("openai", seen),
        max_retries=0,
    )
    an = anthropic.Anthropic(
        base_url=env["ANTHROPIC_BASE_URL"],
        api_key=env["ANTHROPIC_API_KEY"],
        http_client=_recording_client("anthropic", seen),
        max_retries=0,
    )
    message: Any = [{"role": "user", "content": "hi"}]
    calls: list[Callable[[], Any]] = [
        lambda: oa.chat.completions.create(model=env["OPENAI_MODEL"], messages=message),
        lambda: oa.responses.create(model=env["OPENAI_MODEL"], input="hi"),
        lambda: an.messages.create(model=env["ANTHROPIC_MODEL"], max_tokens=16, messages=message),
    ]
    for call in calls:
        try:
            call()
        except (openai.NotFoundError, anthropic.NotFoundError):
            pass
    return seen


__all__ = ["CLIENT_VARS", "sent_by_each_client"]
