"""A scripted OpenAI-compatible chat model (Starlette app), vLLM-shaped answers.

``GET /v1/models`` and ``POST /v1/chat/completions``. Answers follow
:mod:`rollout_gateway.scripted.policy` and are tokenized by
:mod:`rollout_gateway.scripted.tokenizer`. Like vLLM, it adds top-level
``prompt_token_ids`` and per-choice ``token_ids`` when the request has
``return_token_ids: true``, and ``choices[].logprobs.content[]`` when it has
``logprobs: true``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_gateway.scripted import tokenizer as tok
from rollout_gateway.scripted.context import DEFAULT_MAX_MODEL_LEN, ContextCheck, completion_room
from rollout_gateway.scripted.faults import FaultPlan, Ledger, dropped_after
from rollout_gateway.scripted.policy import Action, decide
from rollout_gateway.server.agents.sse import iter_completion_sse
from rollout_gateway.server.http.responses import (
    ApiError,
    api_error_handler,
    read_json_object,
    validate_messages,
)

_MAX_BODY_BYTES = 64 * 1024 * 1024


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", "invalid_request_error")
    return value


def _asked_max_tokens(body: dict[str, Any]) -> tuple[int | None, str]:
    """The request's completion bound and the field it came in."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = _int_or_none(body.get(key), key)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"'{key}' must be at least 1", "invalid_request_error")
            return value, key
    return None, "max_tokens"


def _answer_message(
    action: Action, tokenizer: tok.ByteTokenizer, max_tokens: int | None
) -> tuple[dict[str, Any], list[int], list[bytes], str]:
    """The assistant message, its completion ids and pieces, and its finish reason."""
    tool_calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in action.tool_calls
    ]
    full_text = (action.text or "") + "".join(
        tok.render_tool_call(c.name, c.arguments) for c in action.tool_calls
    )
    completion_ids, pieces = tokenizer.completion(full_text)
    message: dict[str, Any] = {"role": "assistant", "content": action.text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if max_tokens is not None and len(completion_ids) > max_tokens:
        # Cut short like a real model: partial text, no parsed tool call.
        completion_ids, pieces = completion_ids[:max_tokens], pieces[:max_tokens]
        text = b"".join(pieces).decode("utf-8", errors="replace")
        return {"role": "assistant", "content": text}, completion_ids, pieces, "length"
    return message, completion_ids, pieces, action.finish_reason


def build_completion(
    body: dict[str, Any],
    model_name: str,
    max_model_len: int | None = None,
    tokenizer: tok.ByteTokenizer = tok.BYTES,
    context_check: ContextCheck = "vllm",
) -> dict[str, Any]:
    """The ``chat.completion`` dict the scripted model answers to request ``body``.

    With ``max_model_len``, the request is checked against that context as the engine
    named by ``context_check`` checks it (:mod:`.context`): refused with its 400, or
    answered with a completion that fits the room the prompt leaves.
    """
    messages = validate_messages(body)
    temperature = body.get("temperature")
    if temperature is not None and not isinstance(temperature, int | float):
        raise ApiError(400, "'temperature' must be a number", "invalid_request_error")
    seed = _int_or_none(body.get("seed"), "seed")
    asked, asked_as = _asked_max_tokens(body)
    prompt_ids = tokenizer.encode_prompt(messages)
    max_tokens = completion_room(
        len(prompt_ids), asked, window=max_model_len, check=context_check, asked_as=asked_as
    )
    action = decide(messages, temperature=temperature, seed=seed, tools=body.get("tools"))
    message, completion_ids, pieces, finish_reason = _answer_message(action, tokenizer, max_tokens)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": _logprobs(completion_ids, pieces) if body.get("logprobs") else None,
        "finish_reason": finish_reason,
    }
    completion: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(completion_ids),
            "total_tokens": len(prompt_ids) + len(completion_ids),
        },
    }
    if body.get("return_token_ids"):
        completion["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = completion_ids
    return completion


def _logprobs(completion_ids: list[int], pieces: list[bytes]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": _token_str(t, piece),
                "logprob": tok.token_logprob(t),
                "bytes": list(piece),
                "top_logprobs": [],
            }
            for t, piece in zip(completion_ids, pieces, strict=True)
        ]
    }


def _completion_ids(completion: dict[str, Any]) -> list[int]:
    choices = completion.get("choices") or [{}]
    return list(choices[0].get("token_ids") or ())


async def _served(
    chunks: list[bytes], completion: dict[str, Any], ledger: Ledger | None
) -> AsyncIterator[bytes]:
    """A streamed answer's chunks; the ledger notes it once the last one is out."""
    for chunk in chunks:
        yield chunk
    if ledger is not None:
        ledger.served(completion, _completion_ids(completion))


def _answer(
    body: dict[str, Any], completion: dict[str, Any], *, dropped: bool, ledger: Ledger | None
) -> Response:
    """The answer to ``body``: ``completion`` whole or streamed as asked; ``dropped``: the
    connection closes halfway (a fault); the ledger notes what was served in full."""
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = list(iter_completion_sse(completion, include_usage=include_usage))
        if dropped:
            content: Any = dropped_after(chunks, max(1, len(chunks) // 2))
        else:
            content = _served(chunks, completion, ledger)
        return StreamingResponse(content, media_type="text/event-stream")
    raw = bytes(JSONResponse(completion).body)
    if dropped:
        half = dropped_after([raw[: len(raw) // 2]], 1)
        return StreamingResponse(half, media_type="application/json")
    if ledger is not None:
        ledger.served(completion, _completion_ids(completion))
    return Response(raw, media_type="application/json")


def _token_str(token_id: int, piece: bytes) -> str:
    if not piece or token_id < 256:  # a special token, or the byte tokenizer's
        return tok.token_str(token_id)
    return piece.decode("utf-8", errors="replace")


def create_scripted_model_app(
    *,
    model_name: str = "scripted",
    latency_ms: float = 0.0,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    bytes_per_token: int = 1,
    context_check: ContextCheck = "vllm",
    faults: FaultPlan | None = None,
    ledger: Ledger | None = None,
) -> Starlette:
    """The scripted model's ASGI app. Its OpenAI base URL is ``http://host:port/v1``.

    ``latency_ms`` is added (as an ``asyncio.sleep``) to every chat completion, to emulate
    generation time without blocking other requests. ``max_model_len``: the context it
    serves (its model card says it; ``None``: no limit), each request checked against it
    as the engine named by ``context_check`` checks it (:mod:`.context`: ``vllm``, the
    default, or ``sglang``).
    ``bytes_per_token``: 1 is the byte tokenizer; more cuts text into chunks of that many
    bytes (:class:`~rollout_gateway.scripted.tokenizer.ChunkTokenizer`: a real
    tokenizer's bytes per token, for benchmarks).
    """
    tokenizer = tok.tokenizer_for(bytes_per_token)

    async def models(request: Request) -> Response:
        card: dict[str, Any] = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "rollout-gateway",
        }
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(request: Request) -> Response:
        fault = faults.draw() if faults is not None else None
        if fault == "error":
            error = {"message": "fault: internal server error", "type": "InternalServerError"}
            return JSONResponse({"error": {**error, "code": 500}}, status_code=500)
        body = await read_json_object(request, _MAX_BODY_BYTES)
        completion = build_completion(body, model_name, max_model_len, tokenizer, context_check)
        if ledger is not None:
            ledger.stamp(completion)
        delay_s = latency_ms / 1000.0 + (faults.slow_s if fault == "slow" and faults else 0.0)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        return _answer(body, completion, dropped=fault == "drop", ledger=ledger)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error_handler},
    )


__all__ = ["build_completion", "create_scripted_model_app"]
