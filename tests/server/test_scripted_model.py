"""The scripted model: policy, tokenizer, and vLLM-shaped answers."""

from __future__ import annotations

import json

import httpx
import pytest

from rollout_gateway.scripted import DONE_TEXT, create_scripted_model_app, decide, find_script
from rollout_gateway.scripted import tokenizer as tok

from .conftest import script


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str = "x") -> dict:
    return {"role": "assistant", "content": text}


def test_step_index_is_the_number_of_assistant_messages() -> None:
    s = script({"tool": "ls", "arguments": {"path": "/"}}, {"say": "two"})
    first = decide([user(s)])
    assert first.finish_reason == "tool_calls"
    assert first.tool_calls[0].name == "ls"
    assert json.loads(first.tool_calls[0].arguments) == {"path": "/"}
    second = decide([user(s), assistant(), {"role": "tool", "content": "out"}])
    assert (second.text, second.finish_reason) == ("two", "stop")
    past_end = decide([user(s), assistant(), assistant()])
    assert past_end.text == DONE_TEXT
    assert decide([user("no script here")]).text == DONE_TEXT


def test_script_found_in_system_or_user_only_first_match() -> None:
    sys_msg = {"role": "system", "content": script({"say": "from system"})}
    assert decide([sys_msg, user(script({"say": "from user"}))]).text == "from system"
    tool_msg = {"role": "tool", "content": script({"say": "from tool"})}
    assert decide([tool_msg, user("hi")]).text == DONE_TEXT
    parts = {"role": "user", "content": [{"type": "text", "text": script({"say": "parts"})}]}
    assert decide([parts]).text == "parts"
    assert find_script([user("<script>not json</script>")]) is None


def test_one_of() -> None:
    s = script({"one_of": [{"say": "a"}, {"say": "b"}, {"say": "c"}]})
    assert decide([user(s)]).text == "a"
    assert decide([user(s)], temperature=0).text == "a"
    seeded = {decide([user(s)], temperature=1.0, seed=7).text for _ in range(5)}
    assert len(seeded) == 1  # the same seed, the same pick
    picks = {decide([user(s)], temperature=1.0, seed=k).text for k in range(40)}
    assert picks == {"a", "b", "c"}
    nested = script({"one_of": [{"one_of": [{"tool": "t", "arguments": {}}]}]})
    assert decide([user(nested)]).tool_calls[0].name == "t"


def test_tokenizer_ids() -> None:
    assert tok.encode_text("hé") == [104, 195, 169]
    assert tok.encode_message({"role": "user", "content": "hi"}) == [
        tok.IM_START, *b"user\nhi", tok.IM_END,
    ]  # fmt: skip
    prompt = tok.encode_prompt([{"role": "user", "content": "hi"}])
    assert prompt[-len(b"assistant\n") - 1 :] == [tok.IM_START, *b"assistant\n"]
    assert tok.encode_completion("ok") == [111, 107, tok.IM_END]
    assert tok.decode([104, 105, tok.IM_END]) == "hi"
    assert tok.token_logprob(0) == pytest.approx(-0.01)
    assert tok.token_logprob(49) == pytest.approx(-0.5)


@pytest.fixture
def model_client() -> httpx.AsyncClient:
    app = create_scripted_model_app(model_name="scripted-test")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://model/v1")


async def test_models_endpoint(model_client: httpx.AsyncClient) -> None:
    r = await model_client.get("/models")
    assert r.json()["data"][0]["id"] == "scripted-test"


async def test_vllm_shaped_answer(model_client: httpx.AsyncClient) -> None:
    messages = [user(script({"tool": "run", "arguments": {"cmd": "ls"}}))]
    body = {"messages": messages, "return_token_ids": True, "logprobs": True}
    r = (await model_client.post("/chat/completions", json=body)).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "run"
    assert r["prompt_token_ids"] == tok.encode_prompt(messages)
    expected = tok.encode_completion(tok.render_tool_call("run", '{"cmd": "ls"}'))
    assert choice["token_ids"] == expected
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [
        tok.token_logprob(i) for i in expected
    ]
    assert r["usage"] == {
        "prompt_tokens": len(r["prompt_token_ids"]),
        "completion_tokens": len(expected),
        "total_tokens": len(r["prompt_token_ids"]) + len(expected),
    }
    plain = (await model_client.post("/chat/completions", json={"messages": messages})).json()
    assert "prompt_token_ids" not in plain and plain["choices"][0]["logprobs"] is None


async def test_max_tokens_cuts_with_length(model_client: httpx.AsyncClient) -> None:
    body = {"messages": [user(script({"say": "hello world"}))], "max_tokens": 4}
    r = (await model_client.post("/chat/completions", json=body)).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["message"]["content"] == "hell"
    body = {"messages": [user(script({"tool": "t", "arguments": {}}))], "max_tokens": 3}
    r = (await model_client.post("/chat/completions", json=body)).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in r["choices"][0]["message"]


async def test_streaming_and_bad_requests(model_client: httpx.AsyncClient) -> None:
    body = {"messages": [user(script({"say": "hey"}))], "stream": True}
    r = await model_client.post("/chat/completions", json=body)
    assert r.text.endswith("data: [DONE]\n\n")
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in r.text.split("\n\n")
        if line.startswith("data: {")
    ]
    assert "".join(deltas) == "hey"
    assert (await model_client.post("/chat/completions", content=b"nope")).status_code == 400
    bad = {"messages": [user("x")], "max_tokens": "ten"}
    assert (await model_client.post("/chat/completions", json=bad)).status_code == 400


async def test_chunk_tokenizer_has_a_real_tokenizers_bytes_and_ids() -> None:
    app = create_scripted_model_app(bytes_per_token=4)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://model/v1")
    text = "the quick brown fox jumps over the lazy dog, again and again"
    messages = [user(script({"say": text}))]
    body = {"messages": messages, "return_token_ids": True, "logprobs": True}
    r = (await client.post("/chat/completions", json=body)).json()
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == -(-len(text) // 4) + 1 and ids[-1] == tok.IM_END
    assert all(258 <= i < tok.CHUNK_VOCAB for i in ids[:-1])
    assert len(set(ids)) > len(ids) // 2  # chunks, not bytes
    content = r["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == text
    # The completion's ids are its message's in the next prompt (the recorder's prefix).
    follow = [*messages, {"role": "assistant", "content": text}, user("next")]
    again = (await client.post("/chat/completions", json={**body, "messages": follow})).json()
    first_turn = r["prompt_token_ids"] + ids
    assert again["prompt_token_ids"][: len(first_turn)] == first_turn
    cut = (await client.post("/chat/completions", json={**body, "max_tokens": 2})).json()
    assert cut["choices"][0]["message"]["content"] == text[:8]
    assert cut["choices"][0]["finish_reason"] == "length"


def test_the_command_lines_default_context_is_the_apps() -> None:
    from rollout_gateway.cli import ScriptedModelProcess
    from rollout_gateway.scripted.context import DEFAULT_MAX_MODEL_LEN

    assert ScriptedModelProcess().max_model_len == DEFAULT_MAX_MODEL_LEN
