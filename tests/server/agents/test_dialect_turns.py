"""Anthropic Messages and OpenAI Responses turns through the gateway, with the official
SDKs as the agents: routes, keys, answers, the recorded step, retries, count_tokens."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from starlette.responses import JSONResponse

from rollout_gateway.server.agents.dialect_turns import CHAT, dialect_fingerprint
from rollout_gateway.server.dialects import AnthropicDialect, ResponsesDialect
from rollout_gateway.server.http.jsonio import SPLICE_MIN_BYTES

from ..conftest import GatewayHarness, RecordingUpstream, script

BASH = {
    "name": "Bash",
    "description": "Run a command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}
TASK = script({"tool": "Bash", "arguments": {"command": "ls"}}, {"say": "Two files."})
CODEX_TASK = script({"tool": "exec_command", "arguments": {"cmd": "ls"}}, {"say": "Two files."})


def claude(
    gw: GatewayHarness, rollout: str | None = "r1", key: str | None = None, **kw: Any
) -> anthropic.AsyncAnthropic:
    """An Anthropic SDK client as Claude Code builds it: ``ANTHROPIC_BASE_URL`` is the
    rollout's URL (the SDK appends ``/v1/messages``), the key goes as ``x-api-key``."""
    base = f"http://gateway/v1/rollouts/{rollout}" if rollout else "http://gateway"
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(gw.app))
    api_key = key if key is not None else gw.keys.get(rollout or "r1", "rk-unknown")
    kw.setdefault("max_retries", 0)
    return anthropic.AsyncAnthropic(base_url=base, api_key=api_key, http_client=http, **kw)


def codex(
    gw: GatewayHarness, rollout: str | None = "r1", key: str | None = None, **kw: Any
) -> openai.AsyncOpenAI:
    """An OpenAI SDK client on the rollout's URL (``/responses``) or, keyed, the
    gateway's ``/v1`` (``/v1/responses``)."""
    base = f"http://gateway/v1/rollouts/{rollout}" if rollout else "http://gateway/v1"
    http = httpx.AsyncClient(transport=httpx.ASGITransport(gw.app))
    api_key = key if key is not None else gw.keys.get(rollout or "r1", "rk-unknown")
    kw.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=base, api_key=api_key, http_client=http, **kw)


async def steps(gw: GatewayHarness, rollout: str = "r1") -> list[dict[str, Any]]:
    answer = await gw.trajectory(rollout)
    assert answer.status_code == 200, answer.text
    trajectory: list[dict[str, Any]] = answer.json()["trajectory"]
    return trajectory


# -- Messages --------------------------------------------------------------------------


async def test_a_claude_conversation_is_recorded_token_exact_as_one_branch(
    gw: GatewayHarness,
) -> None:
    await gw.register("r1")
    client = claude(gw)
    messages: list[Any] = [{"role": "user", "content": TASK}]
    first = await client.messages.create(
        model="claude-x", max_tokens=512, messages=messages, tools=[BASH],
        system=[{"type": "text", "text": "You are terse."}], metadata={"user_id": "u"},
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    call = next(block for block in first.content if block.type == "tool_use")
    assert (call.name, call.input) == ("Bash", {"command": "ls"})
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "a.txt b.txt"}
        ]},
    ]  # fmt: skip
    second = await client.messages.create(
        model="claude-x", max_tokens=512, messages=messages, tools=[BASH],
        system=[{"type": "text", "text": "You are terse."}],
    )  # fmt: skip
    assert [b.text for b in second.content if b.type == "text"] == ["Two files."]
    assert second.stop_reason == "end_turn"
    recorded = await steps(gw)
    assert len(recorded) == 2
    for step in recorded:
        assert step["extras"]["dialect"] == "anthropic"
        assert step["tokens"]["prompt_ids"] and step["tokens"]["completion_ids"]
    one, two = recorded
    assert one["prompt"][0] == {"role": "system", "content": "You are terse."}
    assert one["completion"][0]["tool_calls"][0]["function"]["name"] == "Bash"
    assert "metadata" in one["extras"]["ignored_fields"]
    assert two["prompt"][-1]["role"] == "tool"
    # The second prompt's tokens extend the first turn's prompt + completion.
    head = one["tokens"]["prompt_ids"] + one["tokens"]["completion_ids"]
    assert two["tokens"]["prompt_ids"][: len(head)] == head


async def test_messages_by_key_and_the_query_string(gw: GatewayHarness) -> None:
    await gw.register("r1")
    await gw.register("r2")
    client = claude(gw, rollout=None, key=gw.keys["r2"])
    answer = await client.messages.create(
        model="m", max_tokens=64, messages=[{"role": "user", "content": script({"say": "k"})}]
    )
    assert answer.content[0].type == "text" and answer.content[0].text == "k"
    assert len(await steps(gw, "r2")) == 1 and await steps(gw, "r1") == []
    # Claude Code posts ?beta=true, with its beta headers.
    r = await gw.client.post(
        "/v1/rollouts/r1/v1/messages?beta=true",
        json={"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": gw.keys["r1"], "anthropic-beta": "claude-code-20250219",
                 "anthropic-version": "2023-06-01", "Authorization": ""},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and len(await steps(gw, "r1")) == 1


async def test_count_tokens_is_answered_and_never_recorded(gw: GatewayHarness) -> None:
    await gw.register("r1", max_turns=1)
    client = claude(gw)
    count = await client.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": "hello " * 50}], tools=[BASH]
    )
    assert count.input_tokens > 50
    answer = await gw.trajectory("r1")
    assert answer.json()["num_turns"] == 0 and answer.json()["trajectory"] == []
    # By key too, and it does not use the rollout's one turn.
    keyed = claude(gw, rollout=None)
    await keyed.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])
    await client.messages.create(
        model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}]
    )


async def test_messages_keys_and_unknown_rollouts_are_the_sdks_typed_errors(
    gw: GatewayHarness,
) -> None:
    await gw.register("r1")
    await gw.register("r2")
    ask: dict[str, Any] = {
        "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]
    }  # fmt: skip
    # Another rollout's key is the same 404 as an unknown rollout (no oracle).
    with pytest.raises(anthropic.NotFoundError) as found:
        await claude(gw, key=gw.keys["r2"]).messages.create(**ask)
    assert found.value.body["type"] == "error"  # type: ignore[index]
    assert found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        await claude(gw, rollout="nope").messages.create(**ask)
    with pytest.raises(anthropic.AuthenticationError):
        await claude(gw, rollout=None, key="rk-not-a-key").messages.create(**ask)
    r = await gw.client.post("/v1/rollouts/r1/v1/messages", json=ask, headers={"Authorization": ""})
    assert r.status_code == 401 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        await claude(gw).messages.create(model="m", max_tokens=16, messages=[])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude(gw).messages.create(**ask, extra_body={"mcp_servers": [{"url": "x"}]})
    assert "mcp_servers" in str(refused.value)
    assert await steps(gw) == []


async def test_a_refusal_at_max_turns_is_final_and_tells_the_env(gw: GatewayHarness) -> None:
    await gw.register("r1", max_turns=1)
    client = claude(gw, max_retries=2)
    ask: dict[str, Any] = {
        "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]
    }  # fmt: skip
    await client.messages.create(**ask)
    ask["messages"] = [*ask["messages"], {"role": "assistant", "content": "Done."},
                       {"role": "user", "content": "more"}]  # fmt: skip
    with pytest.raises(anthropic.PermissionDeniedError) as refused:
        await client.messages.create(**ask)
    assert refused.value.response.headers["x-should-retry"] == "false"
    body = refused.value.body
    assert body["error"]["details"]["error_code"] == "max_turns_reached"  # type: ignore[index]
    assert gw.gateway.metrics.refused_turns.value("max_turns_reached") == 1
    reports = gw.gateway.exit_board.since(0)["exits"]
    assert [(e["rollout_id"], e.get("refused")) for e in reports] == [("r1", "max_turns_reached")]


# -- Responses -------------------------------------------------------------------------


async def test_a_codex_conversation_is_recorded_as_one_branch(gw: GatewayHarness) -> None:
    await gw.register("r1")
    client = codex(gw)
    items: list[Any] = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": CODEX_TASK}]},
    ]  # fmt: skip
    first = await client.responses.create(
        model="codex-x", input=items, tools=[EXEC], store=False, prompt_cache_key="k",
        include=["reasoning.encrypted_content"],
    )  # fmt: skip
    call = next(item for item in first.output if item.type == "function_call")
    assert (call.name, json.loads(call.arguments)) == ("exec_command", {"cmd": "ls"})
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "a b"})
    second = await client.responses.create(model="codex-x", input=items, tools=[EXEC])
    assert second.output_text == "Two files." and second.status == "completed"
    one, two = await steps(gw)
    assert one["extras"]["dialect"] == two["extras"]["dialect"] == "responses"
    assert one["prompt"][0]["role"] in ("system", "developer")
    assert {"store", "include", "prompt_cache_key"} <= set(one["extras"]["ignored_fields"])
    head = one["tokens"]["prompt_ids"] + one["tokens"]["completion_ids"]
    assert two["tokens"]["prompt_ids"][: len(head)] == head


async def test_responses_by_key_errors_and_previous_response_id(gw: GatewayHarness) -> None:
    await gw.register("r1")
    answer = await codex(gw, rollout=None).responses.create(model="m", input="hi")
    assert answer.output_text == "Done."
    with pytest.raises(openai.AuthenticationError):
        await codex(gw, rollout=None, key="nope").responses.create(model="m", input="hi")
    with pytest.raises(openai.NotFoundError):
        await codex(gw, rollout="nope").responses.create(model="m", input="hi")
    with pytest.raises(openai.BadRequestError) as refused:
        await codex(gw).responses.create(model="m", input="hi", previous_response_id="resp_1")
    assert refused.value.param == "previous_response_id"  # type: ignore[attr-defined]
    assert len(await steps(gw)) == 1


# -- retries ----------------------------------------------------------------------------


async def test_the_same_body_in_two_dialects_is_two_turns(gw: GatewayHarness) -> None:
    """A body valid as chat and as Messages: the chat request does not join (or replay)
    the Messages turn."""
    await gw.register("r1")
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]}
    headers = {"x-api-key": gw.keys["r1"], "x-stainless-retry-count": "1"}
    r = await gw.client.post("/v1/rollouts/r1/v1/messages", json=body, headers=headers)
    assert r.json()["type"] == "message"
    # A Messages retry joins its turn: its answer replayed in its own dialect.
    again = await gw.client.post("/v1/rollouts/r1/v1/messages", json=body, headers=headers)
    assert again.json() == r.json()
    # The same bytes as a chat retry: a turn of its own.
    r = await gw.chat("r1", body, headers={"x-stainless-retry-count": "1"})
    assert r.json()["object"] == "chat.completion"
    assert [s["extras"]["dialect"] for s in await steps(gw)] == ["anthropic", "chat"]


async def test_a_replayed_answer_is_rendered_in_the_replaying_dialect(
    gw: GatewayHarness,
) -> None:
    await gw.register("r1")
    headers = {"Idempotency-Key": "turn-1"}
    first = await codex(gw).responses.create(model="m", input="hi", extra_headers=headers)
    again = await codex(gw).responses.create(model="m", input="hi", extra_headers=headers)
    assert again.id == first.id and again.output_text == first.output_text
    assert len(await steps(gw)) == 1


async def test_a_streamed_messages_retry_gets_the_same_stream(gw: GatewayHarness) -> None:
    """The Anthropic SDK marks its retries (``x-stainless-retry-count``): a retry of a
    streamed turn whose answer is in replays it, in the same events."""
    await gw.register("r1")
    body = {"model": "m", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": TASK}], "tools": [BASH]}  # fmt: skip
    headers = {"x-api-key": gw.keys["r1"]}
    url = "/v1/rollouts/r1/v1/messages"
    first = await gw.client.post(url, json=body, headers=headers)
    retry = {**headers, "x-stainless-retry-count": "1"}
    again = await gw.client.post(url, json=body, headers=retry)
    assert first.headers["content-type"].startswith("text/event-stream")
    assert again.text == first.text and "event: message_stop" in first.text
    assert len(await steps(gw)) == 1


async def test_the_sdk_retries_an_upstream_failure_into_one_turn(
    make_gateway: Any,
) -> None:
    upstream = RecordingUpstream()
    fail_once = [True]
    app = upstream.app()

    async def flaky(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions") and fail_once:
            fail_once.clear()
            response = JSONResponse({"error": {"message": "busy"}}, status_code=503)
            await response(scope, receive, send)
            return
        await app(scope, receive, send)

    gw = await make_gateway(flaky)
    await gw.register("r1")
    answer = await claude(gw, max_retries=2).messages.create(
        model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}]
    )
    assert answer.type == "message"
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 1 and len(traj["failed_turns"]) == 1


# -- long histories ------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["anthropic", "responses"])
async def test_a_long_history_reaches_the_engine_as_a_fresh_translation(
    make_gateway: Any, dialect: str
) -> None:
    """A history past :data:`SPLICE_MIN_BYTES` is spliced into the upstream request (as
    a chat body's is): every turn the engine gets the messages a fresh translation of
    the agent's body makes, and the turns are one branch."""
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    system = "You are an agent. " + "é\x00 x" * (SPLICE_MIN_BYTES // 4)
    says = [f"Step {i} done." for i in range(3)]
    task = script(*({"say": text} for text in says))
    turns: list[Any] = [{"role": "user", "content": [{"type": "text", "text": task}]}]
    items: list[Any] = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": system}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": task}]},
    ]  # fmt: skip
    for i, text in enumerate(says):
        if dialect == "anthropic":
            body: dict[str, Any] = {"model": "m", "max_tokens": 64, "system": system,
                                    "messages": turns}  # fmt: skip
            r = await gw.client.post(
                "/v1/rollouts/r1/v1/messages", json=body, headers={"x-api-key": gw.keys["r1"]}
            )
            fresh = AnthropicDialect().parse(json.loads(json.dumps(body)))
        else:
            body = {"model": "m", "input": items, "store": False}
            r = await gw.client.post(
                "/v1/rollouts/r1/responses", json=body, headers=gw.agent_headers("r1")
            )
            fresh = ResponsesDialect().parse(json.loads(json.dumps(body)))
        assert r.status_code == 200, r.text
        assert len(fresh.messages_text) >= SPLICE_MIN_BYTES
        assert upstream.requests[-1]["messages"] == json.loads(fresh.messages_text)
        if dialect == "anthropic":
            assert r.json()["content"][0]["text"] == text
            turns.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
            turns.append({"role": "user", "content": [{"type": "text", "text": f"Go on {i}."}]})
        else:
            assert r.json()["output"][-1]["content"][0]["text"] == text
            items.append({"type": "message", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": text,
                                       "annotations": []}]})  # fmt: skip
            items.append({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": f"Go on {i}."}]})  # fmt: skip
    recorded = await steps(gw)
    assert len(recorded) == 3
    for before, after in zip(recorded, recorded[1:], strict=False):
        head = before["tokens"]["prompt_ids"] + before["tokens"]["completion_ids"]
        assert after["tokens"]["prompt_ids"][: len(head)] == head  # one branch


async def test_each_route_reads_the_key_where_its_dialects_clients_send_it(
    gw: GatewayHarness,
) -> None:
    """A Responses route reads the bearer only (as the chat route: an ``x-api-key``
    header is no key there); a Messages route reads ``x-api-key``, else the bearer."""
    await gw.register("r1")
    key = gw.keys["r1"]
    responses = {"model": "m", "input": "hi"}
    messages = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]}
    for path, body, headers, status in [
        ("/v1/rollouts/r1/responses", responses, {"x-api-key": key}, 401),
        ("/v1/rollouts/r1/responses", responses, {"Authorization": f"Bearer {key}"}, 200),
        ("/v1/responses", responses, {"x-api-key": key}, 401),
        ("/v1/responses", responses, {"Authorization": f"Bearer {key}"}, 200),
        ("/v1/rollouts/r1/v1/messages", messages, {"x-api-key": key}, 200),
        ("/v1/rollouts/r1/v1/messages", messages, {"Authorization": f"Bearer {key}"}, 200),
    ]:
        r = await gw.client.post(path, json=body, headers={"Authorization": "", **headers})
        assert r.status_code == status, (path, headers, r.text)


@pytest.mark.parametrize("dialect", [AnthropicDialect(), ResponsesDialect()])
@pytest.mark.parametrize("fingerprint", [bytes(range(16)), b"\xff" * 32, b""])
def test_a_dialect_fingerprint_is_the_body_fingerprint_hashed_with_the_dialect_name(
    dialect: Any, fingerprint: bytes
) -> None:
    # The digest a stored turn was keyed by before (fed in two updates): a retry across
    # a gateway upgrade still finds its turn.
    expected = hashlib.blake2b(fingerprint, digest_size=len(fingerprint) or 16)
    expected.update(dialect.name.encode())
    assert dialect_fingerprint(dialect, fingerprint) == expected.digest()
    assert dialect_fingerprint(CHAT, fingerprint) == fingerprint
