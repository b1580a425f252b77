"""Fake engines answering in the exact shapes real engines build (tests only).

SGLang: shapes as built by ``python/sglang/srt/entrypoints/openai/serving_chat.py``
(``_build_chat_response``) and ``protocol.py`` of SGLang's main branch, read in a current
fork snapshot (the ``sgl-project/sglang`` snapshot stored for this project,
0c078e6f42685e4918bd79a94a025261c7f38942, predates the token-id flags; it shows the
same ``meta_info`` / ``metadata.weight_version`` shapes): per choice
``prompt_token_ids`` when the request sets ``return_prompt_token_ids`` (or
``return_token_ids``), the sampled ids as ``token_ids`` with ``return_token_ids``, and
``meta_info`` (with ``output_token_logprobs`` entries ``[logprob, token_id, text]``,
``finish_reason: {"type", "matched"}``, ``cached_tokens``) with ``return_meta_info``;
``matched_stop`` on the choice; ``metadata: {"weight_version": ...}`` at the top level;
no top-level ``prompt_token_ids``. Streaming requests with any of those flags get 400
(``_convert_to_internal_request`` raises ValueError). ``/v1/models`` cards say
``owned_by: "sglang"`` and carry ``max_model_len``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_gateway.scripted import build_completion
from rollout_gateway.scripted import tokenizer as tok
from rollout_gateway.server.http.responses import ApiError


def _error(message: str) -> Response:
    """SGLang's 400 (``create_error_response``)."""
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequest", "code": 400},
        status_code=400,
    )


@dataclass
class FakeSGLang:
    """An SGLang-shaped upstream over the scripted model.

    ``ids_in``: ``"token_ids"`` (``return_token_ids`` honoured) or ``"meta_info"`` (an
    SGLang without ``return_token_ids`` on chat: ids only in ``meta_info``).
    """

    ids_in: str = "token_ids"
    weight_version: str = "default"
    max_model_len: int = 8192
    cached_tokens: int = 3
    requests: list[dict[str, Any]] = field(default_factory=list)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """The SGLang answer to ``body``, from the scripted model's decision (a request
        that does not fit ``max_model_len`` raises SGLang's refusal, as SGLang checks)."""
        plain = build_completion(
            {**body, "return_token_ids": True, "logprobs": True},
            "m",
            max_model_len=self.max_model_len,
            context_check="sglang",
        )
        prompt_ids = plain.pop("prompt_token_ids")
        choices = []
        for index, choice in enumerate(plain["choices"]):
            ids = choice.pop("token_ids")
            finish = choice["finish_reason"]
            matched = tok.IM_END if finish in ("stop", "tool_calls") else None
            meta = {
                "id": plain["id"],
                "finish_reason": {"type": finish, "matched": matched},
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "cached_tokens": self.cached_tokens,
                "weight_version": self.weight_version,
                "output_token_logprobs": [[tok.token_logprob(t), t, tok.token_str(t)] for t in ids],
            }
            message = choice["message"]
            out: dict[str, Any] = {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": message.get("content") or "",
                    "tool_calls": message.get("tool_calls"),
                    "reasoning_content": None,
                },
                "logprobs": choice["logprobs"] if body.get("logprobs") else None,
                "finish_reason": finish,
                "matched_stop": matched,
                "hidden_states": None,
            }
            if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
                out["prompt_token_ids"] = prompt_ids
            if body.get("return_token_ids") and self.ids_in == "token_ids":
                out["token_ids"] = ids
            if body.get("return_meta_info"):
                out["meta_info"] = meta
            choices.append(out)
        return {
            "id": plain["id"],
            "object": "chat.completion",
            "created": plain["created"],
            "model": body.get("model"),
            "choices": choices,
            "usage": {**plain["usage"], "prompt_tokens_details": None},
            "metadata": {"weight_version": self.weight_version},
        }

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.requests.append(body)
            if body.get("stream") and (
                body.get("return_prompt_token_ids")
                or body.get("return_token_ids")
                or body.get("return_meta_info")
            ):
                message = (
                    "return_prompt_token_ids is not supported with streaming. "
                    "Please set stream=false when using return_prompt_token_ids=true."
                )
                return _error(message)
            try:
                return JSONResponse(self.answer(body))
            except ApiError as exc:
                return _error(exc.message)

        async def models(request: Request) -> Response:
            card = {
                "id": "m",
                "object": "model",
                "created": 0,
                "owned_by": "sglang",
                "root": "m",
                "max_model_len": self.max_model_len,
            }
            return JSONResponse({"object": "list", "data": [card]})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )
