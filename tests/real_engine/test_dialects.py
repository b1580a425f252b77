"""Anthropic Messages and OpenAI Responses turns against the real vLLM, streamed, with the
official SDKs as the agents: the events reach the agent as the engine decodes, the
helpers assemble the answer, and each step is token-exact (the prompt ids are the
engine's own rendering of the recorded messages, the completion ids what it sampled)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from .conftest import RealGateway, Stopwatch

SHELL = {
    "name": "run_shell",
    "description": "run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


def check_step(step: dict[str, Any], output_tokens: int) -> dict[str, Any]:
    t: dict[str, Any] = step["tokens"]
    assert t is not None and t["prompt_ids"] and t["completion_ids"]
    assert len(t["completion_logprobs"]) == len(t["completion_ids"])
    assert t["completion_mask"] == [1] * len(t["completion_ids"])
    assert len(t["completion_ids"]) == output_tokens  # what the agent was told it used
    assert step["extras"]["status"] == "ok"
    timing = step["extras"]["timing"]
    assert timing["first_token_s"] is not None and timing["first_token_s"] < timing["upstream_s"]
    return t


def claude_client(real: RealGateway, rollout_id: str) -> anthropic.AsyncAnthropic:
    """The official SDK as the rollout's agent."""
    return anthropic.AsyncAnthropic(
        base_url=f"{str(real.control.base_url).rstrip('/')}/v1/rollouts/{rollout_id}",
        api_key=real.keys[rollout_id],
        http_client=httpx2.AsyncClient(timeout=300),
        max_retries=0,
    )


async def test_a_streamed_claude_rollout_is_token_exact(real: RealGateway) -> None:
    # One untimed turn first: the gateway and this client share one event loop, and the
    # first stream pays one-time costs (the SDK's event types, the engine's grammar for
    # the forced call) that on a slow shared CPU can outlast the whole answer and bunch
    # its events (a CI run on 2026-11-30: 17 deltas within 4 ms, after 2.3 s).
    await real.register("warm-up", sampling_params={"temperature": 0, "seed": 7})
    async with claude_client(real, "warm-up").messages.stream(
        model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "Hi."}],
        tools=[SHELL], tool_choice={"type": "tool", "name": "run_shell"},
    ) as stream:  # fmt: skip
        await stream.get_final_message()
    await real.register("claude", sampling_params={"temperature": 0, "seed": 7})
    client = claude_client(real, "claude")
    messages: list[Any] = [{"role": "user", "content": "List the files."}]
    clock = Stopwatch()
    seen: list[tuple[str, float]] = []
    async with client.messages.stream(
        model="claude-x", max_tokens=40, messages=messages, tools=[SHELL],
        tool_choice={"type": "tool", "name": "run_shell"},
        system=[{"type": "text", "text": "You are a shell agent."}],
    ) as stream:  # fmt: skip
        async for event in stream:
            seen.append((event.type, clock()))
        first = await stream.get_final_message()
    deltas = [at for kind, at in seen if kind in ("input_json", "text")]
    summary = (f"first event {seen[0][1]:.2f} s, {len(deltas)} deltas over "
               f"{deltas[-1] - deltas[0]:.2f} s, whole turn {clock():.2f} s")  # fmt: skip
    print(f"\nmessages stream: {summary}")
    assert seen[0][0] == "message_start"
    # The arguments arrived piece by piece as the engine decoded them (~20 tokens/s).
    assert len(deltas) >= 5 and deltas[-1] - deltas[0] > 0.1, summary
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "run_shell"
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "a.txt\nb.txt"}]},
    ]  # fmt: skip
    async with client.messages.stream(
        model="claude-x", max_tokens=12, messages=messages, tools=[SHELL],
        system=[{"type": "text", "text": "You are a shell agent."}],
    ) as stream:  # fmt: skip
        second = await stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    steps = (await real.trajectory("claude"))["trajectory"]
    assert [s["extras"]["dialect"] for s in steps] == ["anthropic", "anthropic"]
    for step, answer in zip(steps, (first, second), strict=True):
        t = check_step(step, answer.usage.output_tokens)
        assert len(t["prompt_ids"]) == answer.usage.input_tokens
        # The prompt ids are the engine's own rendering of the recorded (chat) messages.
        assert t["prompt_ids"] == await real.tokenize(step["prompt"], step["extras"]["tools"])
    assert steps[0]["prompt"][0] == {"role": "system", "content": "You are a shell agent."}
    assert steps[1]["prompt"][-1]["role"] == "tool"


async def test_a_streamed_codex_turn_is_token_exact(real: RealGateway) -> None:
    await real.register("codex", sampling_params={"temperature": 0, "seed": 7})
    client = openai.AsyncOpenAI(
        base_url=f"{str(real.control.base_url).rstrip('/')}/v1/rollouts/codex",
        api_key=real.keys["codex"],
        http_client=httpx.AsyncClient(timeout=300),
        max_retries=0,
    )
    items: list[Any] = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "Answer briefly."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Name a colour."}]},
    ]  # fmt: skip
    async with client.responses.stream(
        model="codex-x", input=items, max_output_tokens=12, store=False
    ) as stream:
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    response = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text and response.output_text == text
    step = (await real.trajectory("codex"))["trajectory"][0]
    assert step["extras"]["dialect"] == "responses"
    assert response.usage is not None
    t = check_step(step, response.usage.output_tokens)
    assert len(t["prompt_ids"]) == response.usage.input_tokens
    assert t["prompt_ids"] == await real.tokenize(step["prompt"])
    assert step["completion"][0]["content"] == text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_over_the_context_is_the_sdks_bad_request(
    real: RealGateway, stream: bool
) -> None:
    await real.register("long")
    client = anthropic.AsyncAnthropic(
        base_url=f"{str(real.control.base_url).rstrip('/')}/v1/rollouts/long",
        api_key=real.keys["long"],
        http_client=httpx2.AsyncClient(timeout=300),
        max_retries=2,
    )
    long_prompt = "word " * 5000
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": long_prompt}],
            stream=stream,
        )  # fmt: skip
    assert refused.value.response.headers["x-should-retry"] == "false"
    traj = await real.trajectory("long")
    assert traj["truncation_reason"] == "context_length_exceeded"


async def test_count_tokens_is_the_engines_own_count(real: RealGateway) -> None:
    await real.register("count", sampling_params={"temperature": 0})
    client = anthropic.AsyncAnthropic(
        base_url=f"{str(real.control.base_url).rstrip('/')}/v1/rollouts/count",
        api_key=real.keys["count"],
        http_client=httpx2.AsyncClient(timeout=300),
        max_retries=0,
    )
    ask: dict[str, Any] = {
        "messages": [{"role": "user", "content": "List the files."}],
        "tools": [SHELL],
        "system": "You are a shell agent.",
    }
    count = await client.messages.count_tokens(model="m", **ask)
    answer = await client.messages.create(model="m", max_tokens=4, **ask)
    assert count.input_tokens == answer.usage.input_tokens
    steps = (await real.trajectory("count"))["trajectory"]
    assert len(steps) == 1 and len(steps[0]["tokens"]["prompt_ids"]) == count.input_tokens
