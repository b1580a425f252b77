"""Agents that send no sampling parameters, on a real vLLM, with nothing registered (issue 30).

The common case: mini-swe-agent (through litellm), many CLI agents and a v1 env without
``[sampling] max_tokens`` send no ``max_tokens``. Before, the gateway sent the rollout's
remaining budget (4,000,000) and vLLM refused it: the rollout ended on its first turn.
Each sampling field the gateway adds or bounds is checked here against the real engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from .conftest import RealGateway, real_gateway

FIXTURES = Path(__file__).parent / "fixtures"


def sdk(real: RealGateway, rollout_id: str) -> openai.AsyncOpenAI:
    """The agent's OpenAI SDK, pointed at its rollout."""
    return openai.AsyncOpenAI(
        base_url=f"{str(real.control.base_url).rstrip('/')}/v1/rollouts/{rollout_id}",
        api_key=real.keys[rollout_id],
        max_retries=0,
    )


async def window(real: RealGateway) -> int:
    """The engine's context (its model card's ``max_model_len``)."""
    card = (await real.engine.get(f"{real.engine_url}/models")).json()["data"][0]
    return int(card["max_model_len"])


async def roomy_prompt(real: RealGateway, room: int, tail: str = "Count to three.") -> str:
    """A user message whose prompt leaves ``room`` tokens of the engine's context: with
    no ``max_tokens`` the engine fills what is left (this base model rarely stops by
    itself), so a turn costs ``room`` tokens of decoding, not the whole context."""
    target = await window(real) - room
    words = target - len(await real.tokenize([{"role": "user", "content": tail}]))
    for _ in range(3):  # each " a" is one token; the joints may take one more or less
        text = "a" + " a" * (words - 1) + "\n" + tail
        length = len(await real.tokenize([{"role": "user", "content": text}]))
        if length == target:
            return text
        words -= length - target
    raise AssertionError(f"no prompt of {target} tokens (last: {length})")


async def test_the_issues_reproduction_gives_a_normal_answer(real: RealGateway) -> None:
    """The issue's reproduction: registered with no sampling, one turn with messages
    only. The engine gives what its context leaves (before: 400, rollout over). The
    prompt leaves 48 tokens of context: this base model rarely stops by itself, and
    decoding the whole context on a CPU outlasts any client's timeout."""
    await real.register("r1", max_turns=5)
    text = await roomy_prompt(real, 48, "Say hi.")
    r = await real.chat("r1", {"messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    traj = await real.trajectory("r1")
    assert traj["num_turns"] == 1 and not traj.get("truncation_reason")
    step = traj["trajectory"][0]
    assert step["tokens"]["completion_ids"]
    assert "max_tokens" not in step["extras"]["sampling"]  # nobody set one: none was sent
    assert step["extras"]["agent_sampling"] == {}


async def test_messages_only_through_the_sdk_until_the_context_is_full(real: RealGateway) -> None:
    """The OpenAI SDK with messages only: a turn takes the room its prompt leaves, and
    the rollout ends as truncated when the next turn cannot fit: refused by the gateway
    when the last turn filled the context (``max_context``, the rollout's ``max_seq_len``
    being the engine's context), else by the engine (``context_length_exceeded``, the
    prompt's own fault) - never as a refused ``max_tokens``."""
    await real.register("r1", max_turns=5)
    client = sdk(real, "r1")
    messages: list[Any] = [{"role": "user", "content": await roomy_prompt(real, 48)}]
    reply = await client.chat.completions.create(model="agent", messages=messages)
    filled = reply.choices[0].finish_reason == "length"
    messages += [reply.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "Go on. " * 40}]
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(model="agent", messages=messages)
    reason = "max_context" if filled else "context_length_exceeded"
    code = "max_context_reached" if filled else "context_length_exceeded"
    assert refused.value.status_code == (403 if filled else 400)
    assert refused.value.code == code
    traj = await real.trajectory("r1")
    assert traj["truncation_reason"] == reason
    assert traj["trajectory"][0]["is_truncated"] is filled


@pytest.mark.parametrize("shape", ["litellm-openai", "litellm-hosted_vllm"])
async def test_litellms_request_shapes(real: RealGateway, shape: str) -> None:
    """The bodies litellm sends for ``openai/<model>`` and ``hosted_vllm/<model>`` with
    messages only (recorded from litellm itself: fixtures/README.md), their user message
    grown to leave 48 tokens of context, written as litellm writes its JSON."""
    recorded = json.loads((FIXTURES / f"{shape}.json").read_text())
    body = json.loads(recorded["body"])
    assert set(body) == {"model", "messages"}  # no sampling parameter at all
    user = body["messages"][-1]
    user["content"] = await roomy_prompt(real, 48, user["content"])
    compact = '","' in recorded["body"]
    content = json.dumps(body, separators=(",", ":") if compact else (", ", ": ")).encode()
    await real.register("r1", max_turns=5)
    headers = {**recorded["headers"], **real.agent("r1")}
    r = await real.control.post(recorded["path"], content=content, headers=headers)
    assert r.status_code == 200, r.text
    traj = await real.trajectory("r1")
    assert traj["num_turns"] == 1 and not traj.get("truncation_reason")
    assert "max_tokens" not in traj["trajectory"][0]["extras"]["sampling"]


#: Agent requests that set each field the gateway adds, reads or bounds, and what the
#: engine must then have been sent.
AGENT_FIELDS = [
    {"max_tokens": 1_000_000},
    {"max_completion_tokens": 1_000_000},
    {"max_tokens": 4096},
    {"max_tokens": 8},
    {"n": 3},
    {"logprobs": True, "top_logprobs": 25},
    {"logprobs": False},
    {"stream": False, "stream_options": {"include_usage": True}},
    {"stream": True, "stream_options": {"include_usage": True}},
    {"stream": True, "max_tokens": 50_000},
    {"temperature": 1.7, "seed": 3, "top_p": 0.5},
    {"return_token_ids": True, "logprobs": True},
]


@pytest.mark.parametrize("fields", AGENT_FIELDS, ids=lambda f: ",".join(f))
async def test_each_agent_field_is_served(real: RealGateway, fields: dict[str, Any]) -> None:
    await real.register("r1", max_turns=5, sampling_params={})
    body = {"messages": [{"role": "user", "content": await roomy_prompt(real, 32)}], **fields}
    r = await real.chat("r1", body)
    assert r.status_code == 200, r.text
    traj = await real.trajectory("r1")
    assert traj["status"] == "active" and traj["num_turns"] == 1
    sent = traj["trajectory"][0]["extras"]["sampling"]
    asked = fields.get("max_tokens") or fields.get("max_completion_tokens")
    if asked is None:
        assert "max_tokens" not in sent
    else:
        # Never more than the engine's context.
        assert sent["max_tokens"] == min(asked, await window(real))


#: Registrations that set each field, and the turn with nothing from the agent.
REGISTERED = [
    {"max_tokens": 1_000_000},
    {"max_completion_tokens": 1_000_000},
    {"max_tokens": 16},
    {"n": 2},
    {"top_logprobs": 3},
    {"temperature": 0.0},
]


@pytest.mark.parametrize("sampling", REGISTERED, ids=lambda f: ",".join(f))
async def test_each_registered_field_is_served(real: RealGateway, sampling: dict[str, Any]) -> None:
    await real.register("r1", max_turns=5, sampling_params=sampling)
    text = await roomy_prompt(real, 32)
    r = await real.chat("r1", {"messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    assert (await real.trajectory("r1"))["status"] == "active"


async def test_a_budget_smaller_than_the_context_is_sent() -> None:
    """The rollout's own budget bounds the turn where it is smaller than the context."""
    async with real_gateway() as real:
        await real.register("r1", max_turns=5, max_total_completion_tokens=12)
        r = await real.chat("r1", {"messages": [{"role": "user", "content": "Tell a story."}]})
        assert r.status_code == 200, r.text
        step = (await real.trajectory("r1"))["trajectory"][0]
        assert step["extras"]["sampling"]["max_tokens"] == 12
        assert len(step["tokens"]["completion_ids"]) <= 12


async def test_a_long_prompt_gets_the_room_it_leaves(real: RealGateway) -> None:
    """A prompt near the context with a big ``max_tokens``: vLLM fits the completion to
    the room left (``length``), the rollout goes on."""
    text = await roomy_prompt(real, 16)
    await real.register("r1", max_turns=5)
    r = await real.chat("r1", {"messages": [{"role": "user", "content": text}], "max_tokens": 3000})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    traj = await real.trajectory("r1")
    assert traj["status"] == "active" and not traj.get("truncation_reason")
