"""What the upstream receives: registered model/sampling params win, tokens always asked."""

from __future__ import annotations

from rollout_gateway.server.engines.upstream_request import (
    build_upstream_request,
    flatten_sampling_params,
    max_tokens_to_send,
    requested_max_tokens,
)
from rollout_gateway.server.state.registry import RolloutRecord

from ..conftest import RecordingUpstream, script

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


async def test_registered_params_override_the_agents(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register(
        "r1",
        model="policy-v3",
        sampling_params={
            "temperature": 0.7,
            "top_p": 0.9,
            "max_completion_tokens": 321,
            "extra_body": {"top_k": 20, "min_p": 0.05},
        },
    )
    agent_body = {
        "model": "gpt-agent",
        "messages": [{"role": "user", "content": script({"say": "hi"})}],
        "temperature": 0.0,
        "top_p": 0.1,
        "max_tokens": 5,
        "tools": TOOLS,
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "agent-user",
    }
    r = await gw.chat("r1", agent_body)
    assert r.status_code == 200
    sent = upstream.requests[-1]
    assert sent["model"] == "policy-v3"
    assert sent["temperature"] == 0.7 and sent["top_p"] == 0.9
    assert sent["max_tokens"] == 321 and "max_completion_tokens" not in sent
    assert sent["top_k"] == 20 and sent["min_p"] == 0.05 and "extra_body" not in sent
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "auto"
    # Allowlist: fields an agent may not set are dropped, and the turn lists them.
    assert "user" not in sent
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["messages"] == agent_body["messages"]


async def test_agent_max_tokens_used_when_not_registered(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1", sampling_params={"temperature": 1.0})
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 77}
    await gw.chat("r1", body)
    sent = upstream.requests[-1]
    assert sent["max_tokens"] == 77 and "max_completion_tokens" not in sent
    assert sent["temperature"] == 1.0


def test_build_upstream_request_unit() -> None:
    body = {"messages": [], "max_tokens": 3, "max_completion_tokens": 4, "seed": 1}
    sampling = {"max_tokens": 9, "seed": 2}
    asked = requested_max_tokens(body, sampling)  # the registered value wins
    out = build_upstream_request(
        body, model="m", sampling_params=sampling, max_tokens=max_tokens_to_send(asked, 100, None)
    )
    assert out == {
        "messages": [],
        "seed": 2,
        "max_tokens": 9,
        "model": "m",
        "stream": False,
        "return_token_ids": True,
        "logprobs": True,
    }
    no_limit = build_upstream_request({"messages": []}, model="m", sampling_params={})
    assert "max_tokens" not in no_limit and "max_completion_tokens" not in no_limit


def test_a_rollouts_sampling_is_flattened_once_and_sent_the_same() -> None:
    """A record flattens its registered params once (every turn reads them); what a turn
    sends from them is what flattening them each turn sent."""
    sampling = {"temperature": 0.5, "seed": None, "extra_body": {"top_k": 5, "seed": 3}}
    record = RolloutRecord("r1", "m", sampling, 10, None, "http://u", last_activity=0.0)
    flat = record.flat_sampling
    assert flat == {"temperature": 0.5, "top_k": 5, "seed": 3}
    assert record.flat_sampling is flat and flatten_sampling_params(flat) is flat
    body = {"messages": [], "max_tokens": 7}
    assert requested_max_tokens(body, flat) == requested_max_tokens(body, sampling) == 7
    assert build_upstream_request(body, model="m", sampling_params=flat) == (
        build_upstream_request(body, model="m", sampling_params=sampling)
    )


async def test_agent_sampling_fields_are_dropped_not_forwarded(make_gateway) -> None:
    """Training needs the registered sampling: no agent field reaches the engine unless
    it is on the allowlist, and the recorded turn names what was dropped."""
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1", sampling_params={"temperature": 1.0})
    hostile = {
        "n": 8, "best_of": 8, "logit_bias": {"1": 100}, "top_k": 1, "seed": 7,
        "ignore_eos": True, "echo": True, "chat_template": "{{ 'pwned' }}",
        "truncate_prompt_tokens": 1, "temperature": 0.0, "presence_penalty": 2.0,
        "extra_body": {"top_k": 1}, "min_tokens": 9999,
    }  # fmt: skip
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **hostile}
    assert (await gw.chat("r1", body)).status_code == 200
    sent = upstream.requests[-1]
    assert not set(hostile) - {"temperature"} & set(sent)
    assert sent["temperature"] == 1.0 and sent["tools"] == TOOLS
    step = (await gw.trajectory("r1")).json()["trajectory"][0]
    assert step["extras"]["dropped_fields"] == sorted(hostile)


def test_remaining_budget_caps_max_tokens() -> None:
    asked = requested_max_tokens({"messages": [], "max_tokens": 500}, {})
    assert max_tokens_to_send(asked, 40, None) == 40
    assert max_tokens_to_send(None, 40, None) == 40


async def test_registered_sampling_params_may_not_set_the_conversation(gw) -> None:
    for sampling in (
        {"temperature": 1.0, "messages": [{"role": "user", "content": "hijacked"}]},
        {"extra_body": {"messages": []}},  # flattened the way the engine would see it
        {"prompt": "hijacked"},
    ):
        r = await gw.register("r1", sampling_params=sampling)
        assert r.status_code == 400, r.text
        assert "the conversation is the agent's" in r.json()["error"]["message"]
    assert (await gw.register("r1", sampling_params={"temperature": 1.0})).status_code == 200
