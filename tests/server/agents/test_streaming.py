"""Agents use the real OpenAI SDK: streaming and non-streaming answers must parse."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ..conftest import GatewayHarness, script


def sdk(gw: GatewayHarness, rollout_id: str, api_key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://gateway/v1/rollouts/{rollout_id}",
        api_key=api_key or gw.keys.get(rollout_id, "unused"),
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(gw.app)),
        max_retries=0,
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


async def test_sdk_streaming_tool_call_then_text(gw: GatewayHarness) -> None:
    await gw.register("r1")
    client = sdk(gw, "r1")
    messages = [
        {
            "role": "user",
            "content": script({"tool": "run", "arguments": {"cmd": "ls"}}, {"say": "all good"}),
        }
    ]
    stream = await client.chat.completions.create(
        model="whatever", messages=messages, tools=TOOLS, stream=True
    )
    name, args, call_id, finish = "", "", None, None
    async for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                call_id = call.id or call_id
                name += call.function.name or ""
                args += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, json.loads(args), finish) == ("run", {"cmd": "ls"}, "tool_calls")

    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call_id, "content": "file.txt"})
    stream = await client.chat.completions.create(
        model="whatever",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    assert text == "all good"
    assert usage is not None and usage.completion_tokens > 0

    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 2
    assert traj["trajectory"][0]["completion"][0]["tool_calls"][0]["function"]["name"] == "run"
    # The SDK-built history extends turn 1.
    assert "history_rewritten" not in traj["trajectory"][1]["extras"]


async def test_sdk_stream_accumulates_with_stream_helper(gw: GatewayHarness) -> None:
    await gw.register("r1")
    client = sdk(gw, "r1")
    async with client.chat.completions.stream(
        model="x", messages=[{"role": "user", "content": script({"say": "streamed"})}]
    ) as stream:
        final = await stream.get_final_completion()
    assert final.choices[0].message.content == "streamed"
    assert final.choices[0].finish_reason == "stop"


async def test_sdk_non_streaming(gw: GatewayHarness) -> None:
    await gw.register("r1")
    client = sdk(gw, "r1")
    completion = await client.chat.completions.create(
        model="x",
        messages=[
            {"role": "user", "content": script({"tool": "run", "arguments": {"cmd": "pwd"}})}
        ],
        tools=TOOLS,
    )
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "run" and json.loads(call.function.arguments) == {"cmd": "pwd"}


async def test_sdk_sees_error_message(gw: GatewayHarness) -> None:
    client = sdk(gw, "unknown")
    try:
        await client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}]
        )
    except openai.NotFoundError as exc:
        assert "not registered" in str(exc)
    else:
        raise AssertionError("expected a 404")


async def test_sdk_models_list_shows_the_registered_model(make_gateway) -> None:
    gw = await make_gateway(require_rollout_keys=True)
    key = (await gw.register("r1", model="policy-7b")).json()["api_key"]
    models = await sdk(gw, "r1", api_key=key).models.list()
    # The registered model first, then the upstream's own cards.
    assert [m.id for m in models.data] == ["policy-7b", "scripted"]
    with pytest.raises(openai.NotFoundError):  # not r1's key: as if r1 did not exist
        await sdk(gw, "r1", api_key="wrong").models.list()
