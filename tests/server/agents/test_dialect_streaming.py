"""Messages and Responses turns streamed for real from a vLLM-shaped engine (replayed from
chunks recorded off vLLM 0.32): each engine chunk becomes the dialect's events as it
comes, the SDKs' stream helpers assemble what the non-streamed answer is, the step is
token-exact, and an engine failure mid-stream is the dialect's error event."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import openai
import pytest

from ..conftest import GatewayFactory
from ..engines.test_true_streaming import ReplayVLLM, served_pair
from .test_dialect_turns import claude, codex, steps

SHELL_ANTHROPIC = {
    "name": "run_shell",
    "description": "run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
SHELL_RESPONSES = {
    "type": "function",
    "name": "run_shell",
    "description": "run a shell command",
    "parameters": SHELL_ANTHROPIC["input_schema"],
}


def assert_token_exact(step: dict[str, Any], engine: ReplayVLLM) -> None:
    whole = engine.answer["choices"][0]
    assert step["tokens"]["prompt_ids"] == engine.answer["prompt_token_ids"]
    assert step["tokens"]["completion_ids"] == whole["token_ids"]
    assert step["tokens"]["completion_logprobs"] == pytest.approx(
        [e["logprob"] for e in whole["logprobs"]["content"]], abs=1e-4
    )


def claude_ask(name: str) -> dict[str, Any]:
    ask: dict[str, Any] = {
        "model": "claude-x",
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "List the files."}],
    }
    if name == "tool":
        ask["tools"] = [SHELL_ANTHROPIC]
    return ask


@pytest.mark.parametrize("name", ["text", "tool"])
async def test_a_streamed_message_is_the_whole_message_and_token_exact(
    make_gateway: GatewayFactory, name: str
) -> None:
    engine = ReplayVLLM(name)
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="gemma3-270m")
    await gw.register("r2", model="gemma3-270m")
    async with claude(gw, "r1").messages.stream(**claude_ask(name)) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert engine.bodies[0]["stream"] is True  # streamed from the engine
    whole = await claude(gw, "r2").messages.create(**claude_ask(name))
    assert engine.bodies[1].get("stream") is not True

    # The engine's stream and its whole answer were captured apart (ids differ).
    def shape(message: Any) -> dict[str, Any]:
        dumped: dict[str, Any] = message.model_dump(exclude={"id"})
        dumped["content"] = [{k: v for k, v in b.items() if k != "id"} for b in dumped["content"]]
        return dumped

    assert shape(streamed) == shape(whole)
    if name == "tool":
        assert streamed.stop_reason == "tool_use"
        assert streamed.content[-1].type == "tool_use"
    step = (await steps(gw, "r1"))[0]
    assert step["extras"]["dialect"] == "anthropic"
    assert step["extras"]["timing"]["first_token_s"] is not None
    assert_token_exact(step, engine)


@pytest.mark.parametrize("name", ["text", "tool"])
async def test_a_streamed_response_is_the_whole_response_and_token_exact(
    make_gateway: GatewayFactory, name: str
) -> None:
    engine = ReplayVLLM(name)
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="gemma3-270m")
    await gw.register("r2", model="gemma3-270m")
    ask: dict[str, Any] = {"model": "codex-x", "input": "List the files.", "max_output_tokens": 24}
    if name == "tool":
        ask["tools"] = [SHELL_RESPONSES]
    async with codex(gw, "r1").responses.stream(**ask) as stream:
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # A length cut is "incomplete" as OpenAI's (the helper's final response then raises).
    assert kinds[-1] in ("response.completed", "response.incomplete")
    streamed = events[-1].response  # type: ignore[union-attr]
    whole = await codex(gw, "r2").responses.create(**ask)
    unshared = ("id", "call_id", "parsed_arguments")

    def shape(response: Any) -> list[Any]:
        return [
            {k: v for k, v in item.model_dump().items() if k not in unshared}
            for item in response.output
        ]

    assert shape(streamed) == shape(whole)
    assert (streamed.status, streamed.usage) == (whole.status, whole.usage)
    step = (await steps(gw, "r1"))[0]
    assert step["extras"]["dialect"] == "responses"
    assert_token_exact(step, engine)


async def test_the_first_event_goes_out_with_the_engines_first_chunk() -> None:
    """The engine sends its first chunk and falls silent: the agent already has
    ``message_start``, then the dialect's own keepalive (``event: ping``)."""
    hold = asyncio.Event()
    engine = ReplayVLLM("text", hold=hold)
    body = claude_ask("text") | {"stream": True}
    async with served_pair(engine, stream_keepalive_s=0.05) as client:
        r = await client.post("/v1/rollouts/r1/register", json={"model": "gemma3-270m"})
        agent = {"x-api-key": r.json()["api_key"]}
        seen = b""
        async with client.stream("POST", "/v1/rollouts/r1/v1/messages", json=body,
                                 headers=agent) as r:  # fmt: skip
            assert r.status_code == 200
            async for piece in r.aiter_bytes():
                seen += piece
                if seen.count(b"event: ping") >= 2:
                    hold.set()
        assert seen.startswith(b"event: message_start")
        assert seen.index(b"event: ping") < seen.index(b"content_block_delta")
        assert seen.rstrip().endswith(b'data: {"type":"message_stop"}')
        step = (await client.get("/v1/rollouts/r1/trajectory")).json()["trajectory"][0]
    assert step["tokens"]["completion_ids"] == engine.answer["choices"][0]["token_ids"]


async def engine_fails_mid_stream(make_gateway: GatewayFactory) -> Any:
    engine = ReplayVLLM("text")
    first_block = engine.raw.split("\n\n")[0]
    error = {"error": {"message": "KV cache lost", "type": "X", "code": 500}}
    engine.raw = f"{first_block}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n"
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="gemma3-270m")
    return gw


async def test_an_engine_error_mid_stream_is_the_messages_error_event(
    make_gateway: GatewayFactory,
) -> None:
    gw = await engine_fails_mid_stream(make_gateway)
    with pytest.raises(anthropic.APIStatusError) as failed:
        async with claude(gw).messages.stream(**claude_ask("text")) as stream:
            async for _ in stream:
                pass
    assert "upstream error 500" in str(failed.value)
    traj = (await gw.trajectory("r1")).json()
    assert traj["trajectory"] == [] and traj["failed_turns"][0]["error"]["type"] == "protocol"


async def test_an_engine_error_mid_stream_fails_the_response(
    make_gateway: GatewayFactory,
) -> None:
    gw = await engine_fails_mid_stream(make_gateway)
    kinds = []
    with pytest.raises(openai.APIError) as failed:
        async with codex(gw).responses.stream(model="m", input="hi") as stream:
            async for event in stream:
                kinds.append(event.type)
    assert kinds[0] == "response.created"  # the stream had started
    assert "upstream error 500" in str(failed.value)
    traj = (await gw.trajectory("r1")).json()
    assert traj["trajectory"] == [] and traj["failed_turns"][0]["error"]["type"] == "protocol"
