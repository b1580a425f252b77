"""Every error a Messages or Responses turn can get, in the dialect's shape: the official
SDKs raise their own typed errors, refusals say not to retry and end the agent env-side."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest

from ..conftest import GatewayFactory, RecordingUpstream
from .test_dialect_turns import claude, codex, steps

ASK: dict[str, Any] = {
    "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]
}  # fmt: skip
OVERFLOW = (
    "This model's maximum context length is 4096 tokens. However, your prompt contains at "
    "least 4097 input tokens, which exceeds this limit even without any output tokens. "
    "Please reduce the length of the input prompt. (parameter=input_tokens, value=4097)"
)


def exits(gw: Any) -> list[tuple[str, str | None]]:
    return [(e["rollout_id"], e.get("refused")) for e in gw.gateway.exit_board.since(0)["exits"]]


async def test_a_body_over_the_limit_is_413_in_each_dialect(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(max_body_bytes=2000)
    await gw.register("r1")
    big = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(anthropic.APIStatusError) as claude_error:
        await claude(gw).messages.create(model="m", max_tokens=16, messages=big)
    assert claude_error.value.status_code == 413
    assert claude_error.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as codex_error:
        await codex(gw).responses.create(model="m", input="x" * 5000)
    assert codex_error.value.status_code == 413 and codex_error.value.code


async def test_an_upstream_failure_is_the_sdks_server_error(make_gateway: GatewayFactory) -> None:
    upstream = RecordingUpstream(status=500, error_body={"error": {"message": "boom"}})
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    with pytest.raises(anthropic.InternalServerError) as claude_error:
        await claude(gw).messages.create(**ASK)
    assert claude_error.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    with pytest.raises(openai.InternalServerError):
        await codex(gw).responses.create(model="m", input="x")
    # Streamed, before anything was sent: the HTTP status still says it.
    with pytest.raises(anthropic.InternalServerError):
        async with claude(gw).messages.stream(**ASK) as stream:
            async for _ in stream:
                pass
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 0 and len(traj["failed_turns"]) == 3


async def test_a_prompt_over_the_context_ends_the_rollout_in_the_dialects_words(
    make_gateway: GatewayFactory,
) -> None:
    upstream = RecordingUpstream(status=400, error_body={"error": {"message": OVERFLOW}})
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    with pytest.raises(anthropic.BadRequestError) as overflow:
        await claude(gw, max_retries=2).messages.create(**ASK)
    assert overflow.value.response.headers["x-should-retry"] == "false"
    body = overflow.value.body
    assert body["error"]["details"]["error_code"] == "context_length_exceeded"  # type: ignore[index]
    traj = (await gw.trajectory("r1")).json()
    assert traj["truncation_reason"] == "context_length_exceeded"
    assert traj["trajectory"][0]["extras"]["dialect"] == "anthropic"
    assert exits(gw) == [("r1", "context_length_exceeded")]
    # Every later turn is refused, final.
    with pytest.raises(openai.APIStatusError) as later:
        await codex(gw, max_retries=2).responses.create(model="m", input="x")
    assert later.value.response.headers["x-should-retry"] == "false"
    assert len(upstream.requests) == 1


async def test_a_token_budget_refusal_is_final_in_responses(gw: Any) -> None:
    await gw.register("r1", max_total_completion_tokens=1)
    client = codex(gw, max_retries=2)
    await client.responses.create(model="m", input="first")
    with pytest.raises(openai.APIStatusError) as refused:
        await client.responses.create(
            model="m",
            input=[
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": "more"},
            ],
        )
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert refused.value.code == "max_completion_tokens_reached"
    assert [s["extras"]["dialect"] for s in await steps(gw)] == ["responses"]
    assert exits(gw) == [("r1", "max_completion_tokens_reached")]


async def test_a_malformed_body_is_a_bad_request_naming_the_field(gw: Any) -> None:
    await gw.register("r1")
    headers = {"x-api-key": gw.keys["r1"]}
    r = await gw.client.post("/v1/rollouts/r1/v1/messages", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(openai.BadRequestError) as bad:
        await codex(gw).responses.create(model="m", input=[{"type": "item_reference", "id": "x"}])
    assert bad.value.param  # type: ignore[attr-defined]
    r = await gw.client.get("/v1/rollouts/r1/v1/messages", headers=headers)
    assert r.status_code == 405
    assert await steps(gw) == []


async def test_too_many_pending_turns_is_the_sdks_rate_limit_error(
    make_gateway: GatewayFactory,
) -> None:
    upstream = RecordingUpstream(latency_s=0.3)
    gw = await make_gateway(upstream.app(), max_pending_turns=1)
    await gw.register("r1")
    client = claude(gw)
    slow = asyncio.create_task(client.messages.create(**ASK))
    await asyncio.sleep(0.1)
    other = {**ASK, "messages": [{"role": "user", "content": "y"}]}
    with pytest.raises(anthropic.RateLimitError) as limited:
        await client.messages.create(**other)
    assert limited.value.body["error"]["details"]["error_code"] == "too_many_pending_turns"  # type: ignore[index]
    assert (await slow).type == "message"
