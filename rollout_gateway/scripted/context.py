"""The scripted model's context window, checked the way a real engine checks it.

``vllm`` (the default) is what vLLM 0.32 does, as seen from the real server
(`tests/real_engine`): a ``max_tokens`` over the context is refused; a prompt over the
context is refused; a prompt that fills it leaves ``max_tokens`` at 0, refused; anything
else is answered, the completion fitted to the room the prompt leaves (``finish_reason:
length`` when that cuts it). ``sglang`` is SGLang's stricter check: a prompt plus
``max_tokens`` over the context is refused. Each refusal carries the engine's own
wording, so the gateway meets the same messages as in front of the real engine
(:mod:`rollout_gateway.server.engines.context_refusal` reads them).
"""

from __future__ import annotations

from typing import Literal

from rollout_gateway.server.http.responses import ApiError

ContextCheck = Literal["vllm", "sglang"]

#: The context the scripted model serves unless told otherwise (2**20 tokens: its tokens
#: are bytes, so about the text of a 256k-token context of a real tokenizer). Every
#: test and demo then meets an engine that refuses what does not fit, as a real one does.
DEFAULT_MAX_MODEL_LEN = 1_048_576


def _refused(message: str) -> ApiError:
    return ApiError(400, message, "BadRequestError")


def _vllm_room(prompt: int, asked: int | None, asked_as: str, window: int) -> int:
    if asked is not None and asked > window:
        raise _refused(
            f"{asked_as}={asked} cannot be greater than max_model_len={window}. Please "
            f"request fewer output tokens. (parameter={asked_as}, value={asked})"
        )
    if prompt > window:  # vLLM tokenizes at most window + 1 tokens, hence "at least"
        raise _refused(
            f"This model's maximum context length is {window} tokens. However, your prompt "
            f"contains at least {window + 1} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={window + 1})"
        )
    if prompt == window:
        raise _refused("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")
    return window - prompt


def _sglang_room(prompt: int, asked: int | None, window: int) -> int:
    if prompt >= window:
        raise _refused(
            f"The input ({prompt} tokens) is longer than the model's context length "
            f"({window} tokens)."
        )
    if asked is not None and prompt + asked > window:
        raise _refused(
            f"Requested token count exceeds the model's maximum context length of {window} "
            f"tokens. You requested a total of {prompt + asked} tokens: {prompt} tokens "
            f"from the input messages and {asked} tokens for the completion. Please reduce "
            "the number of tokens in the input messages or the completion to fit within "
            "the limit."
        )
    return window - prompt


def completion_room(
    prompt: int,
    asked: int | None,
    *,
    window: int | None,
    check: ContextCheck = "vllm",
    asked_as: str = "max_tokens",
) -> int | None:
    """The most completion tokens the engine gives a prompt of ``prompt`` tokens that
    asked for ``asked`` (``asked_as``: the field it came in), or raise the engine's 400.
    ``None``: no window, no bound."""
    if window is None:
        return asked
    room = (
        _sglang_room(prompt, asked, window)
        if check == "sglang"
        else _vllm_room(prompt, asked, asked_as, window)
    )
    return room if asked is None else min(asked, room)


__all__ = ["DEFAULT_MAX_MODEL_LEN", "ContextCheck", "completion_room"]
