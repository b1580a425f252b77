"""The token-in upstream mode: render and bridge like verifiers v1's ``TrainClient``.

In the default (``chat``) mode the engine applies its chat template to each turn's
messages, so the ids of turn ``k + 1`` extend turn ``k``'s prompt + completion only if
re-rendering the sampled answer gives back the sampled ids; any drift (a tool call
re-rendered, a cut completion re-tokenized) forks verifiers v1's trace graph into one
training sample per turn. In ``token-in`` mode the gateway owns tokenization, as
prime-rl's ``TrainClient`` does with the ``renderers`` package:

* turn 1 is rendered with the renderer (``Renderer.render(..., add_generation_prompt=True)``);
* a later turn whose messages extend the previous turn's prompt + answer by tool results
  and/or one user message is *bridged*: ``Renderer.bridge_to_next_turn(previous prompt
  ids, previous completion ids, new messages)`` appends the new messages' tokens to the
  ids already sampled, so the sampled ids are never re-tokenized;
* a turn that cannot be bridged (history edited, the renderer cannot bridge) is rendered
  from scratch; the recorder flags it ``prefix_break`` when its ids do not extend the
  previous turn's (as in chat mode); the step's ``extras.bridged`` says which path ran;
* the ids go to vLLM's token-in endpoint ``POST /inference/v1/generate`` (vLLM 0.32
  serves it when started with ``--enable-scale-out``, answers 403 without), and the
  completion ids are parsed back into content and tool calls by the renderer's parser.

The answer is then an ordinary vLLM chat completion (``prompt_token_ids``, the choice's
``token_ids`` and ``logprobs``), so the recording, the budgets and the agent's answer
(streamed too: one chunk built from the whole answer, with keepalives while it is
sampled) are the chat mode's own code (:mod:`.turn`, :mod:`~rollout_gateway.server.agents.chat`).

Why ``renderers.client.generate`` is not called as is: it checks each logprob entry for
``token == "token_id:N"``, while vLLM 0.32's token mode answers ``{"token_id": N,
"logprob": x}`` (``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``,
``GenerateLogProbsContent``; verified against the real server), so every answer is
refused as malformed. The gateway posts the same request body ``generate`` builds
(``token_ids``, ``sampling_params`` with the renderer's ``stop_token_ids``,
``logprobs: 1``, ``skip_special_tokens: false``) through its own upstream pool (timeouts,
health, error mapping as in chat mode), reads both logprob shapes, and composes the rest
from ``renderers``: :func:`renderers.base.load_tokenizer`, :func:`renderers.create_renderer`,
``render`` / ``bridge_to_next_turn`` / ``parse_response`` / ``get_stop_token_ids``.

``renderers`` (and ``transformers``, which loads the tokenizer) are optional: the
``[tito]`` extra. They are imported only when this mode is switched on.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_gateway.server.engines.routed_experts import (
    PROMPT_START_FIELD,
    read_routed_experts,
    replay_start,
)
from rollout_gateway.server.engines.upstream import (
    UpstreamError,
    check_answer_writable,
    raise_for_upstream_status,
)
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.responses import ApiError
from rollout_gateway.server.recording.history import recorded_message

if TYPE_CHECKING:
    from rollout_gateway.server.engines.turn import EngineTurn
    from rollout_gateway.server.engines.upstream import Upstream

logger = logging.getLogger("rollout_gateway.server")

T = TypeVar("T")

#: vLLM's token-in endpoint, at the server root (not under ``/v1``).
GENERATE_PATH = "/inference/v1/generate"

#: Agent fields forwarded in chat mode that token-in mode cannot apply.
_NOT_APPLIED = ("tool_choice", "parallel_tool_calls", "response_format")

#: Answers of an engine that does not serve the token-in endpoint (vLLM without
#: ``--enable-scale-out``: 403; older vLLM or another server: 404 / 405).
_UNSERVED = (403, 404, 405)

#: The two upstream modes of ``rollout-gateway serve --upstream-mode``.
UPSTREAM_MODES = ("chat", "token-in")

#: Fields of the chat request that are not engine sampling settings.
_NOT_SAMPLING = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "model",
        "stream",
        "stream_options",
        "include_reasoning",
        "return_token_ids",
        "return_prompt_token_ids",
        "return_meta_info",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
    }
)


class TokenInUnavailable(RuntimeError):
    """Token-in mode was asked for but cannot run (package missing, tokenizer unloadable)."""


def _require_renderers() -> Any:
    try:
        return importlib.import_module("renderers")
    except ImportError as exc:
        raise TokenInUnavailable(
            "--upstream-mode token-in needs the 'renderers' package (and 'transformers' to "
            "load the tokenizer): pip install 'rollout-gateway[tito]'"
        ) from exc


def load_renderer(tokenizer_path: str, renderer: str = "auto") -> Any:
    """A ``renderers`` renderer for the tokenizer at ``tokenizer_path`` (an HF model dir).

    ``renderer``: ``"auto"`` (renderers' own choice from the tokenizer's name, falling
    back to its template-driven default renderer), a renderer name of
    ``renderers.RENDERER_REGISTRY`` (e.g. ``"qwen3"``), or ``"module:attr"``, a callable
    taking the tokenizer and returning a renderer (a custom one). Raises
    :class:`TokenInUnavailable` with the reason.
    """
    renderers = _require_renderers()
    from renderers.base import load_tokenizer

    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except Exception as exc:
        raise TokenInUnavailable(
            f"--tokenizer {tokenizer_path!r}: cannot load a tokenizer: {exc}"
        ) from exc
    try:
        if ":" in renderer:
            module, _, attr = renderer.partition(":")
            factory = getattr(importlib.import_module(module), attr)
            return factory(tokenizer)
        if renderer == "auto":
            return renderers.create_renderer(tokenizer)
        from pydantic import TypeAdapter

        config = TypeAdapter(renderers.RendererConfig).validate_python({"name": renderer})
        return renderers.create_renderer(tokenizer, config)
    except Exception as exc:
        raise TokenInUnavailable(f"--renderer {renderer!r}: {exc}") from exc


def is_bridgeable_tail(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``messages`` (what a turn adds after the previous answer) can be bridged:
    tool results, optionally closed by one user message (no assistant or system text,
    which would re-render tokens the model sampled or change the prefix)."""
    if not messages:
        return False
    roles = [m.get("role") for m in messages]
    if roles[-1] == "user":
        roles = roles[:-1]
    return all(role == "tool" for role in roles)


def sampling_for_generate(upstream_body: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM ``SamplingParams`` fields of a finished chat upstream body (registered
    sampling, the turn's seed, the bounded ``max_tokens``, the agent's ``stop``)."""
    sampling = {k: v for k, v in upstream_body.items() if k not in _NOT_SAMPLING}
    if sampling.get("n", 1) not in (None, 1):
        raise ApiError(
            400,
            "token-in upstream mode samples one choice per turn (registered n > 1)",
            "invalid_request_error",
            code="unsupported_in_token_in_mode",
        )
    sampling.pop("n", None)
    return sampling


def read_generate_logprobs(choice: Mapping[str, Any], completion_ids: list[int]) -> list[float]:
    """Per-token logprobs of a generate answer's choice, in vLLM 0.32's token mode shape
    (``{"token_id": N, "logprob": x}``) or the ``token: "token_id:N"`` one renderers
    expects. Raises :class:`UpstreamError` (502) when they do not match the ids."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list) or len(content) != len(completion_ids):
        raise UpstreamError(
            "protocol", 502, "token-in answer: logprobs do not match the completion ids"
        )
    out: list[float] = []
    for token_id, entry in zip(completion_ids, content, strict=True):
        if not isinstance(entry, Mapping):
            raise UpstreamError("protocol", 502, "token-in answer: malformed logprob entry")
        named = entry.get("token_id")
        if named is None and isinstance(entry.get("token"), str):
            tail = entry["token"].removeprefix("token_id:")
            # isdigit() alone takes "²", which int() refuses, and int() refuses 4300 digits
            named = int(tail) if tail.isascii() and tail.isdigit() and len(tail) <= 18 else None
        value = entry.get("logprob")
        if named != token_id or isinstance(value, bool) or not isinstance(value, int | float):
            raise UpstreamError(
                "protocol", 502, "token-in answer: logprob entry does not match its token id"
            )
        try:
            out.append(float(value))
        except OverflowError:
            raise UpstreamError("protocol", 502, "token-in answer: logprob out of range") from None
    return out


#: Token ids are 32-bit (what the recorder stores); anything else is not an id.
_MAX_TOKEN_ID = 2**31 - 1


def _token_ids(value: Any) -> list[int] | None:
    """``value`` if it is a list of token ids, else ``None``."""
    if isinstance(value, list) and all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in value):
        return value
    return None


@dataclass
class TokenInEngine:
    """The renderer and the generate call of token-in mode (one per gateway).

    Args:
        renderer: a ``renderers`` renderer (see :func:`load_renderer`; tests pass one).
        name: what the renderer is, for logs and the step's extras.
    """

    renderer: Any
    name: str = ""
    #: Upstreams found not serving the token-in endpoint (base URL -> why), for /health.
    unserved: dict[str, str] = field(default_factory=dict)
    #: Encode-side work mutates a fast tokenizer's state: one at a time, on a thread.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.name = self.name or type(self.renderer).__name__

    async def probe(self, upstream: Upstream, timeout_s: float = 5.0) -> None:
        """At start-up: does ``upstream`` serve the token-in endpoint? An empty request
        costs the engine nothing (refused as invalid when served; vLLM without
        ``--enable-scale-out`` answers 403). Never raises: an engine not up yet is
        checked again by its first turn."""
        root = upstream.base_url.rstrip("/").removesuffix("/v1")
        try:
            async with asyncio.timeout(timeout_s):
                response = await upstream.http.post(f"{root}{GENERATE_PATH}", b"{}")
        except Exception as exc:  # unreachable now: the turn will tell
            logger.info("upstream=%s token-in probe failed: %r", upstream.label, exc)
            return
        if response.status_code in _UNSERVED:
            self.unserved[upstream.base_url] = (
                f"does not serve {GENERATE_PATH} (HTTP {response.status_code}): token-in "
                "mode needs vLLM >= 0.32 started with --enable-scale-out"
            )
            logger.error("upstream=%s %s", upstream.label, self.unserved[upstream.base_url])
        else:
            self.unserved.pop(upstream.base_url, None)

    async def _encode(self, fn: Callable[[], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn()

        return await asyncio.to_thread(locked)

    async def prompt_ids(
        self, turn: EngineTurn, tools: list[Any] | None
    ) -> tuple[list[int], int | None]:
        """The turn's prompt ids, and how many ids of the previous turn's prompt +
        completion they were bridged onto (``None``: rendered from scratch).

        Raises :class:`UpstreamError` (400) when the renderer cannot render the agent's
        messages or tools (a tool call that is not an object, arguments that are not
        JSON...): the engine's own template would refuse them so in chat mode.
        """
        try:
            return await self._prompt_ids(turn, tools)
        except Exception as exc:  # the template's error, on the agent's input
            raise UpstreamError(
                "http_4xx",
                400,
                "the chat template cannot render this request's messages or tools",
                f"renderer {self.name} failed on rollout {turn.record.rollout_id}: {exc!r}",
            ) from exc

    async def count_prompt(self, messages: list[Any], tools: list[Any] | None) -> int:
        """How many tokens ``messages`` (chat form) and ``tools`` render to as a prompt
        (a dialect's ``count_tokens``: exact, nothing generated)."""
        recorded = [recorded_message(m) for m in messages]
        rendered = await self._encode(
            lambda: self.renderer.render(recorded, tools=tools, add_generation_prompt=True)
        )
        return len(rendered.token_ids)

    async def _prompt_ids(
        self, turn: EngineTurn, tools: list[Any] | None
    ) -> tuple[list[int], int | None]:
        messages = [recorded_message(m) for m in turn.messages]
        previous = turn.record.recorder.last_turn_ids()
        if previous is not None and turn.shared is not None:
            prev_prompt, prev_completion, held = previous
            tail = messages[held:]
            if turn.shared == held and is_bridgeable_tail(tail):
                bridged = await self._encode(
                    lambda: self.renderer.bridge_to_next_turn(
                        prev_prompt, prev_completion, tail, tools=tools
                    )
                )
                if bridged is not None:
                    return list(bridged.token_ids), len(prev_prompt) + len(prev_completion)
        rendered = await self._encode(
            lambda: self.renderer.render(messages, tools=tools, add_generation_prompt=True)
        )
        return list(rendered.token_ids), None

    async def complete(self, turn: EngineTurn) -> dict[str, Any]:
        """Render (or bridge), generate, parse: the turn's answer as a vLLM chat completion
        (``prompt_token_ids``, ``choices[0].token_ids`` / ``logprobs``). Raises
        :class:`UpstreamError` as the chat mode does."""
        body = turn.upstream_body
        tools = body.get("tools") or None
        if tools and not getattr(self.renderer, "supports_tools", True):
            raise ApiError(
                400,
                f"the gateway's renderer ({self.name}) parses no tool calls: this request's "
                "tools cannot be served in token-in mode (choose a renderer with a tool "
                "parser, rollout-gateway serve --renderer)",
                "invalid_request_error",
                code="unsupported_in_token_in_mode",
            )
        sampling = sampling_for_generate(body)
        prompt_ids, bridged_onto = await self.prompt_ids(turn, tools)
        turn.extras["bridged"] = bridged_onto is not None
        turn.extras["renderer"] = self.name
        # Chat-template controls the generate endpoint has no equivalent for (TrainClient
        # does not apply them either): recorded, so a trainer can see they were not honoured.
        not_applied = sorted(k for k in _NOT_APPLIED if body.get(k) is not None)
        if not_applied:
            turn.extras["not_applied"] = not_applied
        max_len = turn.engine.max_model_len
        if max_len is not None and len(prompt_ids) >= max_len:
            # The engine's own wording, so the overflow is recorded as in chat mode.
            raise UpstreamError(
                "http_4xx",
                400,
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt contains {len(prompt_ids)} input tokens.",
            )
        if max_len is not None:
            # The prompt's length is known here: ask for the room it leaves, or less when
            # less was asked (never more than the engine can give, never less than asked;
            # an older generate endpoint takes a missing max_tokens for 16).
            asked = sampling.get("max_tokens")
            room = max_len - len(prompt_ids)
            sampling["max_tokens"] = min(asked, room) if isinstance(asked, int) else room
        stop_ids = list(self.renderer.get_stop_token_ids())
        for extra in sampling.get("stop_token_ids") or ():
            if extra not in stop_ids:
                stop_ids.append(extra)
        sampling.update(stop_token_ids=stop_ids, logprobs=1)
        sampling.setdefault("skip_special_tokens", False)
        # What the step records as "the sampling actually sent".
        turn.upstream_body = {**sampling, "model": body.get("model")}
        # Router replay (an engine with enable_return_routed_experts): a bridged turn asks
        # only for the positions the previous turns' routing does not hold.
        start = replay_start(bridged_onto) if bridged_onto else 0
        if start:
            sampling = {**sampling, PROMPT_START_FIELD: start}
        answer = await self._post(
            turn, {"model": body.get("model"), "token_ids": prompt_ids, "sampling_params": sampling}
        )
        completion = self._completion(answer, prompt_ids, tools, body.get("model"))
        turn.routed_experts = read_routed_experts(answer["choices"][0], start)
        return completion

    async def _post(self, turn: EngineTurn, request: dict[str, Any]) -> dict[str, Any]:
        pool = turn.pool
        upstream = pool.get(turn.record.upstream)
        label = upstream.label
        root = upstream.base_url.rstrip("/").removesuffix("/v1")
        response = await pool.post(
            turn.record.upstream, f"{root}{GENERATE_PATH}", jsonio.dumps(request)
        )
        if response.status_code in _UNSERVED:
            raise UpstreamError(
                "http_4xx",
                502,
                f"the upstream does not serve {GENERATE_PATH} (HTTP {response.status_code}): "
                "token-in mode needs vLLM >= 0.32 started with --enable-scale-out",
                f"{label} answered {response.status_code} to {GENERATE_PATH}: "
                f"{response.text[:500]}",
            )
        self.unserved.pop(upstream.base_url, None)
        raise_for_upstream_status(response, label)
        try:
            data = jsonio.loads_lenient(response.content)
        except (ValueError, RecursionError) as exc:
            raise UpstreamError("protocol", 502, "token-in answer is not JSON") from exc
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise UpstreamError("protocol", 502, "token-in answer has no choices")
        check_answer_writable(data)
        return data

    def _completion(
        self, data: dict[str, Any], prompt_ids: list[int], tools: Any, model: Any
    ) -> dict[str, Any]:
        choice = data["choices"][0] if data["choices"] else {}
        if not isinstance(choice, Mapping):
            raise UpstreamError("protocol", 502, "token-in answer: a choice is not an object")
        completion_ids = _token_ids(choice.get("token_ids"))
        if completion_ids is None:
            raise UpstreamError("protocol", 502, "token-in answer has no completion ids")
        logprobs = read_generate_logprobs(choice, completion_ids)
        try:
            parsed = self.renderer.parse_response(
                completion_ids, prompt_ids=prompt_ids, tools=tools
            )
        except Exception as exc:  # ids the renderer cannot read (beyond its vocabulary...)
            raise UpstreamError(
                "protocol", 502, "token-in answer: the renderer cannot read its ids", repr(exc)
            ) from exc
        message = assistant_message(parsed)
        finish = choice.get("finish_reason")
        # generate knows no tool_calls finish (renderers' generate promotes it too)
        if "tool_calls" in message and finish == "stop":
            finish = "tool_calls"
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
        if usage is None:
            usage = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion_ids),
                "total_tokens": len(prompt_ids) + len(completion_ids),
            }
        return {
            "id": f"chatcmpl-{data.get('request_id') or secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": created if type(created := data.get("created")) is int else int(time.time()),
            "model": model,
            "prompt_token_ids": prompt_ids,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "stop_reason": choice.get("stop_reason"),
                    "token_ids": completion_ids,
                    "logprobs": {"content": logprob_entries(completion_ids, logprobs)},
                }
            ],
            "usage": usage,
        }


def assistant_message(parsed: Any) -> dict[str, Any]:
    """The renderer's parse of a completion as an OpenAI assistant message: its content,
    the tool calls it parsed whole (each with an id), its reasoning."""
    from renderers.base import ToolCallParseStatus

    calls = [
        {
            "id": tc.id or f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {
                "name": tc.name,
                "arguments": tc.arguments
                if isinstance(tc.arguments, str)
                else json.dumps(tc.arguments or {}),
            },
        }
        for tc in parsed.tool_calls
        if tc.status == ToolCallParseStatus.OK and tc.name
    ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content if parsed.content or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    if parsed.reasoning_content:
        message["reasoning_content"] = parsed.reasoning_content
    return message


def logprob_entries(ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """The OpenAI ``logprobs.content`` of sampled ``ids`` (named ``token_id:<id>``, as vLLM
    names them with ``return_tokens_as_token_ids``; a logprob JSON cannot carry is -9999)."""
    return [
        {
            "token": f"token_id:{t}",
            "logprob": lp if math.isfinite(lp) else -9999.0,
            "bytes": None,
            "top_logprobs": [],
        }
        for t, lp in zip(ids, logprobs, strict=True)
    ]


__all__ = [
    "GENERATE_PATH",
    "UPSTREAM_MODES",
    "TokenInEngine",
    "TokenInUnavailable",
    "is_bridgeable_tail",
    "load_renderer",
    "read_generate_logprobs",
    "sampling_for_generate",
]
