"""Messages and Responses turns in token-in mode: the gateway renders the prompt itself
(the renderer bridges each turn onto the sampled ids), the step is token-exact, and
``count_tokens`` is the renderer's exact count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("renderers", reason="token-in mode needs the [tito] extra (renderers)")
pytest.importorskip("transformers", reason="token-in mode needs the [tito] extra (transformers)")

from ..conftest import GatewayFactory  # noqa: E402
from ..engines.test_token_in import (  # noqa: E402
    FakeTokenEngine,
    token_in_gateway,
    tokenizer_dir,
)
from .test_dialect_turns import claude, codex, steps  # noqa: E402

__all__ = ["tokenizer_dir"]  # the module's fixture, used here

SHELL = {
    "name": "run_shell",
    "description": "Run a shell command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}


def assert_sent_and_sampled(recorded: list[dict[str, Any]], engine: FakeTokenEngine) -> None:
    for step, sent, (ids, logprobs) in zip(recorded, engine.requests, engine.sent, strict=True):
        assert step["tokens"]["prompt_ids"] == sent["token_ids"]
        assert step["tokens"]["completion_ids"] == ids
        assert step["tokens"]["completion_logprobs"] == pytest.approx(logprobs)
    for before, after in zip(recorded, recorded[1:], strict=False):
        head = before["tokens"]["prompt_ids"] + before["tokens"]["completion_ids"]
        assert after["tokens"]["prompt_ids"][: len(head)] == head


async def test_a_messages_rollout_is_token_exact_in_token_in_mode(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ['[run_shell(command="ls")]', "Two files."])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1", sampling_params={"max_tokens": 64})
    client = claude(gw)
    messages: list[Any] = [{"role": "user", "content": "List the files."}]
    count = await client.messages.count_tokens(model="m", messages=messages, tools=[SHELL])
    first = await client.messages.create(model="m", max_tokens=64, messages=messages, tools=[SHELL])
    call = first.content[-1]
    assert call.type == "tool_use" and call.input == {"command": "ls"}
    assert count.input_tokens == len(engine.requests[0]["token_ids"])  # exact
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "a b"}]},
    ]  # fmt: skip
    async with client.messages.stream(
        model="m", max_tokens=64, messages=messages, tools=[SHELL]
    ) as stream:
        second = await stream.get_final_message()
    assert second.content[0].type == "text" and second.content[0].text == "Two files."
    recorded = await steps(gw)
    assert [s["extras"]["dialect"] for s in recorded] == ["anthropic", "anthropic"]
    assert [s["extras"]["bridged"] for s in recorded] == [False, True]
    assert_sent_and_sampled(recorded, engine)


async def test_a_responses_rollout_is_token_exact_in_token_in_mode(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ['[run_shell(command="ls")]', "Two files."])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1", sampling_params={"max_tokens": 64})
    client = codex(gw)
    tool = {"type": "function", "name": "run_shell", "parameters": SHELL["input_schema"]}
    items: list[Any] = [{"role": "user", "content": "List the files."}]
    first = await client.responses.create(model="m", input=items, tools=[tool])  # type: ignore[list-item]
    call = first.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"command": "ls"}
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "a b"})
    second = await client.responses.create(model="m", input=items, tools=[tool])  # type: ignore[list-item]
    assert second.output_text == "Two files."
    recorded = await steps(gw)
    assert [s["extras"]["dialect"] for s in recorded] == ["responses", "responses"]
    assert_sent_and_sampled(recorded, engine)
