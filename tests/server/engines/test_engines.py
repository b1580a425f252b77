"""Engines behind the gateway: SGLang's answer shapes, detection, engines without ids."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from rollout_gateway.scripted import tokenizer as tok
from rollout_gateway.server.engines.answers import read_answer
from rollout_gateway.server.engines.probe import (
    EngineInfo,
    probe_engine,
    read_model_cards,
    token_flags,
)
from rollout_gateway.server.engines.upstream_http1 import Http1Upstream

from ..conftest import UPSTREAM, GatewayFactory, RecordingUpstream, script
from .fake_engines import FakeSGLang

TOOL = {"tool": "run", "arguments": {"cmd": "ls"}}


def _messages() -> list[dict]:
    return [{"role": "user", "content": script(TOOL, {"say": "all done"})}]


@pytest.mark.parametrize("ids_in", ["token_ids", "meta_info"])
async def test_sglang_turns_are_recorded_token_exact(
    make_gateway: GatewayFactory, ids_in: str
) -> None:
    sglang = FakeSGLang(ids_in=ids_in, weight_version="7")
    gw = await make_gateway(sglang.app())
    assert gw.gateway.engines[UPSTREAM].kind == "sglang"
    reg = (await gw.register("r1", max_seq_len=None)).json()
    assert reg["max_seq_len"] == 8192  # none registered: the engine's context length

    messages = _messages()
    first = await gw.chat("r1", messages)
    assert first.status_code == 200
    call = first.json()["choices"][0]["message"]["tool_calls"][0]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"},
    ]
    assert (await gw.chat("r1", messages)).status_code == 200

    # SGLang's flags were sent, not streamed; no top-level ids came back.
    sent = sglang.requests[0]
    assert sent["return_prompt_token_ids"] and sent["return_meta_info"] and sent["logprobs"]
    assert sent["return_token_ids"] and not sent.get("stream")
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    for step in steps:
        t = step["tokens"]
        assert t is not None, step["extras"]
        assert t["prompt_ids"] == tok.encode_prompt(step["prompt"])
        expected_ids = tok.encode_completion(
            (step["completion"][0]["content"] or "")
            + "".join(
                tok.render_tool_call(c["function"]["name"], c["function"]["arguments"])
                for c in step["completion"][0].get("tool_calls") or ()
            )
        )
        assert t["completion_ids"] == expected_ids
        assert t["completion_logprobs"] == pytest.approx(
            [tok.token_logprob(i) for i in expected_ids], rel=1e-6
        )
        assert step["extras"]["stop_reason"] == tok.IM_END  # SGLang's matched_stop
        assert step["extras"]["cached_tokens"] == 3  # from meta_info
        assert step["extras"]["engine_weight_version"] == "7"
        assert step["extras"]["policy_version"] == 7  # the engine's, none announced
    assert steps[1]["extras"]["prefix_break"] is False


async def test_sglang_streaming_agent_gets_a_synthesized_stream(
    make_gateway: GatewayFactory,
) -> None:
    sglang = FakeSGLang()
    gw = await make_gateway(sglang.app())
    await gw.register("r1")
    client = openai.AsyncOpenAI(
        base_url="http://gateway/v1/rollouts/r1",
        api_key=gw.keys["r1"],
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(gw.app)),
        max_retries=0,
    )
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": script({"say": "hello"})}],
        stream=True,
        logprobs=True,
    )
    text, logprobs = "", []
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs += [e.logprob for e in choice.logprobs.content]
    assert text == "hello"
    assert len(logprobs) == len(tok.encode_completion("hello"))  # asked for, delivered
    assert sglang.requests[0].get("stream") is False  # SGLang refuses ids on streams
    step = (await gw.trajectory("r1")).json()["trajectory"][0]
    assert step["tokens"]["completion_ids"] == tok.encode_completion("hello")


def test_read_answer_takes_sglang_meta_info_when_no_token_ids() -> None:
    answer = FakeSGLang(ids_in="meta_info").answer(
        {"messages": [{"role": "user", "content": "hi"}], **token_flags("sglang")}
    )
    read = read_answer(answer)
    assert read.prompt_ids == tok.encode_prompt([{"role": "user", "content": "hi"}])
    assert read.first is not None and read.first.completion_ids == tok.encode_completion("Done.")
    assert read.weight_version == "default" and read.cached_tokens == 3


@pytest.mark.parametrize(
    ("logprobs", "sentinels"),
    [
        ([-0.5, -1.25, -3.0], []),
        ([-0.5, -9999.0, -3.0], [1]),
        ([float("nan"), -0.5, -1.0], [0]),
        ([-0.5, float("-inf"), -1.0], [1]),
        ([-0.5, -1.0, float("inf")], [2]),
        # Finite, but their sum is not: the exact check decides.
        ([-1.7e308, -1.7e308, -0.5], [0, 1]),
        ([-9000.0, -0.1], [0]),  # the bound itself is a sentinel
    ],
)
def test_read_answer_flags_exactly_the_sentinel_logprobs(
    logprobs: list[float], sentinels: list[int]
) -> None:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "abc"},
        "token_ids": [97, 98, 99],
        "logprobs": {"content": [{"token": "x", "logprob": v} for v in logprobs]},
        "finish_reason": "stop",
    }
    first = read_answer({"choices": [choice], "prompt_token_ids": [1, 2]}).first
    assert first is not None and first.sentinels == sentinels


def test_model_cards_name_the_engine_and_its_context() -> None:
    vllm = {"data": [{"id": "g", "owned_by": "vllm", "max_model_len": 4096}]}
    assert read_model_cards(vllm) == ("vllm", 4096)
    assert read_model_cards({"data": [{"id": "m", "owned_by": "sglang"}]}) == ("sglang", None)
    assert read_model_cards({"data": [{"id": "x", "owned_by": "openai"}]}) == ("unknown", None)
    assert read_model_cards("garbage") == ("unknown", None)
    # An unknown engine gets both engines' flags.
    assert set(token_flags("unknown")) == {
        "return_token_ids",
        "logprobs",
        "return_prompt_token_ids",
        "return_meta_info",
    }


async def test_engine_without_token_ids_is_reported_loudly(
    make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await make_gateway(RecordingUpstream(with_tokens=False).app())
    before = (await gw.client.get("/health")).json()["upstreams"][0]
    assert before["token_ids"] is None  # not known before the first answer
    await gw.register("r1")
    with caplog.at_level(logging.ERROR, logger="rollout_gateway.server"):
        for _ in range(2):
            await gw.chat("r1", [{"role": "user", "content": "hi"}])
    loud = [r for r in caplog.records if "NO token ids" in r.getMessage()]
    assert len(loud) == 1  # at the first turn, once
    health = (await gw.client.get("/health")).json()["upstreams"][0]
    assert health["token_ids"] is False and "no token ids" in health["warning"]
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    assert all(s["tokens"] is None and "tokens_missing" in s["extras"] for s in steps)


async def test_logprobs_mode_is_checked_where_vllm_tells(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            card = {"id": "m", "owned_by": "vllm", "max_model_len": 1024}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if request.url.path == "/server_info":  # vLLM with VLLM_SERVER_DEV_MODE=1
            config = {"model_config": {"logprobs_mode": "raw_logprobs"}}
            return httpx.Response(200, json={"vllm_config": config})
        return httpx.Response(404)

    info = EngineInfo()
    client = Http1Upstream("http://engine/v1", transport=httpx.MockTransport(handler))
    with caplog.at_level(logging.WARNING, logger="rollout_gateway.server"):
        await probe_engine(client, info, "http://engine/v1")
    assert (info.kind, info.max_model_len, info.logprobs_mode) == ("vllm", 1024, "raw_logprobs")
    assert any("processed_logprobs" in r.getMessage() for r in caplog.records)
    assert info.describe()["logprobs_mode"] == "raw_logprobs"


async def test_a_dead_engine_probe_never_fails_and_waits_before_retrying() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("boom")

    info = EngineInfo()
    client = Http1Upstream("http://engine/v1", transport=httpx.MockTransport(handler))
    await probe_engine(client, info, "http://engine/v1")
    assert not info.probed and info.kind == "unknown"
    assert info.probed_at is not None
    assert not info.due(info.probed_at + 1) and info.due(info.probed_at + 31)
