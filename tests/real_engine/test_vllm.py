"""The gateway in front of a real vLLM (see conftest): what the trainer receives is exact.

Written for ``tools/real-vllm`` (vLLM 0.32 CPU, Gemma 3 270M base model, 4096-token
context, ``--logprobs-mode processed_logprobs``, ``pythonic`` tool parser): a base model
rarely ends a turn or calls a tool by itself, so tool calls are forced with a named
``tool_choice`` and most plain turns end on ``length``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import httpx
import pytest
from support.tools import RUN_SHELL_TOOL

from rollout_gateway.server.turn_seed import turn_seed

from .conftest import URL_VAR, RealGateway, Stopwatch

TOOLS = [RUN_SHELL_TOOL]
FORCE_TOOL = {"type": "function", "function": {"name": "run_shell"}}
SYSTEM = {"role": "system", "content": "You are a careful assistant with a shell."}


def check_tokens(step: dict[str, Any], *, other_tokens: int = 0) -> dict[str, Any]:
    """A recorded step's tokens, checked for what every trainer relies on.

    ``other_tokens``: completion tokens of the answer's other choices (``n > 1``), which
    the engine's usage counts too.
    """
    t = step["tokens"]
    assert t is not None, step["extras"]
    assert t["prompt_ids"] and t["completion_ids"]
    assert len(t["completion_logprobs"]) == len(t["completion_ids"])  # one per token
    assert all(math.isfinite(x) and x <= 0 for x in t["completion_logprobs"])
    assert t["prompt_mask"] == [0] * len(t["prompt_ids"])
    assert t["completion_mask"] == [1] * len(t["completion_ids"])
    usage = step["extras"]["usage"]
    assert usage["prompt_tokens"] == len(t["prompt_ids"])
    assert usage["completion_tokens"] == len(t["completion_ids"]) + other_tokens
    assert step["extras"]["status"] == "ok"
    return t


async def test_multi_turn_tool_calls_record_exact_ids_and_prefixes(real: RealGateway) -> None:
    reg = await real.register("tools", sampling_params={"temperature": 0.7, "seed": 1234})
    assert reg["max_seq_len"] == 4096  # none registered: the engine's max_model_len
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
    answers = []
    # Turn 1: a forced tool call; turn 2: after its result; turns 3-4: plain follow-ups.
    for turn in range(4):
        body: dict[str, Any] = {
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 40,
            "return_token_ids": True,
            "logprobs": True,
        }
        if turn == 0:
            body["tool_choice"] = FORCE_TOOL
        r = await real.chat("tools", body)
        assert r.status_code == 200, r.text
        answer = r.json()
        answers.append(answer)
        message = answer["choices"][0]["message"]
        if turn == 0:
            call = message["tool_calls"][0]
            assert call["function"]["name"] == "run_shell"
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "a.txt\nb.txt"},
            ]
        else:
            messages += [
                {"role": "assistant", "content": message["content"]},
                {"role": "user", "content": f"Go on ({turn})."},
            ]

    traj = await real.trajectory("tools")
    steps = traj["trajectory"]
    assert traj["num_turns"] == 4 and len(steps) == 4
    for step, answer in zip(steps, answers, strict=True):
        t = check_tokens(step)
        choice = answer["choices"][0]
        # Exactly the ids and logprobs the engine sampled and reported.
        assert t["prompt_ids"] == answer["prompt_token_ids"]
        assert t["completion_ids"] == choice["token_ids"]
        assert t["completion_logprobs"] == pytest.approx(
            [e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-4
        )
        # The prompt ids are the engine's own rendering of the recorded messages.
        assert t["prompt_ids"] == await real.tokenize(step["prompt"], TOOLS)
        assert step["extras"]["finish_reason"] == choice["finish_reason"]
        assert step["is_truncated"] == (choice["finish_reason"] == "length")
    # A forced call's sampled JSON re-renders as [run_shell(...)]: the next prompt does
    # not extend it, and the step says so. Whether a plain turn's prompt extends the
    # previous one depends on how it ended: exact when it stopped on <end_of_turn>, a
    # re-tokenized tail when max_tokens cut it; the flag matches the ids either way.
    assert steps[1]["extras"]["prefix_break"] is True
    breaks = [s["extras"]["prefix_break"] for s in steps[1:]]
    print(f"\ntool turns: prefix_break per turn {breaks}")
    # Plain turns that re-render as sampled extend exactly (turn 4 here: 3 after a plain
    # turn cut by max_tokens re-tokenizes; seeded, so the same on every run).
    assert breaks.count(False) >= 1
    for prev, step in zip(steps, steps[1:], strict=False):
        before = prev["tokens"]["prompt_ids"] + prev["tokens"]["completion_ids"]
        extends = step["tokens"]["prompt_ids"][: len(before)] == before
        assert step["extras"]["prefix_break"] is (not extends)
    # Distinct, reproducible per-turn seeds derived from the registered one.
    seeds = [s["extras"]["sampling"]["seed"] for s in steps]
    assert seeds == [turn_seed(1234, i) for i in range(4)] and len(set(seeds)) == 4


async def test_stop_string_turns_are_flagged_as_prefix_breaks(real: RealGateway) -> None:
    await real.register("plain", sampling_params={"temperature": 0, "max_tokens": 24})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
    for turn in range(3):
        r = await real.chat("plain", {"messages": messages, "stop": ["\n"]})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"Another one ({turn})."},
        ]
    steps = (await real.trajectory("plain"))["trajectory"]
    for prev, step in zip(steps, steps[1:], strict=False):
        check_tokens(step)
        before = prev["tokens"]["prompt_ids"] + prev["tokens"]["completion_ids"]
        extends = step["tokens"]["prompt_ids"][: len(before)] == before
        assert step["extras"]["prefix_break"] is (not extends)
    # A stop string is cut from the text but its token stays in the ids, and the history
    # re-renders the text + <end_of_turn>: each of these prompts breaks, and says so.
    assert all(s["extras"]["prefix_break"] for s in steps[1:])


async def test_context_overflow_is_recorded_and_ends_the_rollout(real: RealGateway) -> None:
    await real.register("overflow", sampling_params={"max_tokens": 8})
    ok = await real.chat("overflow", {"messages": [{"role": "user", "content": "Hello."}]})
    assert ok.status_code == 200
    long_prompt = [{"role": "user", "content": "word " * 5000}]
    r = await real.chat("overflow", {"messages": long_prompt})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 4096" in error["message"]
    assert "rollout is over" in error["message"]  # the agent is told clearly
    later = await real.chat("overflow", {"messages": [{"role": "user", "content": "Hi."}]})
    assert later.status_code in (403, 409)  # refused: the rollout is over

    traj = await real.trajectory("overflow")
    assert traj["is_truncated"] is True
    assert traj["truncation_reason"] == "context_length_exceeded"
    assert traj["status"] == "completed"
    assert traj["num_turns"] == len(traj["trajectory"]) == 2
    step = traj["trajectory"][-1]
    assert step["prompt"] == long_prompt and step["completion"] == []
    assert step["tokens"] is None and step["is_truncated"] is True
    assert step["extras"]["status"] == "error"
    assert step["extras"]["error"]["type"] == "context_length_exceeded"


async def test_streaming_sends_bytes_before_the_engine_finishes(real: RealGateway) -> None:
    await real.register("stream", sampling_params={"temperature": 0, "max_tokens": 96})
    body = {
        "model": "agent",
        "messages": [{"role": "user", "content": "Write a long story about a cat."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "return_token_ids": True,
    }
    clock = Stopwatch()
    first_chunk_s = None
    raw = ""
    url = "/v1/rollouts/stream/chat/completions"
    async with real.control.stream("POST", url, json=body, headers=real.agent("stream")) as r:
        assert r.status_code == 200
        async for text in r.aiter_text():
            if first_chunk_s is None and "data: {" in text:
                first_chunk_s = clock()
            raw += text
    total_s = clock()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or ()]
    logprobs = [
        e["logprob"]
        for c in chunks
        for ch in c["choices"]
        for e in ((ch.get("logprobs") or {}).get("content") or ())
    ]
    prompt_ids = next(c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c)
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert raw.rstrip().endswith("data: [DONE]")
    print(f"\nstreaming: first chunk {first_chunk_s:.2f} s, whole turn {total_s:.2f} s")
    assert first_chunk_s is not None and first_chunk_s < total_s / 3

    step = (await real.trajectory("stream"))["trajectory"][0]
    t = check_tokens(step)
    assert t["prompt_ids"] == prompt_ids  # the recorded turn is complete and exact
    assert t["completion_ids"] == ids and len(ids) == usage["completion_tokens"]
    assert t["completion_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    assert step["extras"]["timing"]["first_token_s"] < step["extras"]["timing"]["upstream_s"]


async def test_finish_reasons_stop_length_and_repetition(real: RealGateway) -> None:
    # stop: a forced tool call ends on <eos>; length: max_tokens; repetition: vLLM's
    # repetition detector (a registered engine parameter) on a base model that loops.
    await real.register("stop", sampling_params={"temperature": 0, "max_tokens": 64})
    r = await real.chat(
        "stop",
        {
            "messages": [{"role": "user", "content": "ls"}],
            "tools": TOOLS,
            "tool_choice": FORCE_TOOL,
        },
    )
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    await real.register("length", sampling_params={"temperature": 0, "max_tokens": 3})
    await real.chat("length", {"messages": [{"role": "user", "content": "Tell me a story."}]})
    detector = {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3}
    await real.register(
        "repeat",
        sampling_params={
            "temperature": 0,
            "max_tokens": 400,
            "extra_body": {"repetition_detection": detector},
        },
    )
    await real.chat("repeat", {"messages": [{"role": "user", "content": "la la la la la la"}]})

    stop = (await real.trajectory("stop"))["trajectory"][0]
    length = (await real.trajectory("length"))["trajectory"][0]
    repeat = (await real.trajectory("repeat"))["trajectory"][0]
    assert stop["extras"]["finish_reason"] in ("stop", "tool_calls") and not stop["is_truncated"]
    assert check_tokens(stop)["completion_ids"][-1] == 1  # <eos>, the sampled stop token
    assert length["extras"]["finish_reason"] == "length" and length["is_truncated"] is True
    assert len(check_tokens(length)["completion_ids"]) == 3
    print(f"\nrepetition turn: finish={repeat['extras']['finish_reason']}")
    assert repeat["extras"]["finish_reason"] == "repetition"
    assert repeat["is_truncated"] is True and repeat["tokens"]["is_truncated"] is True
    check_tokens(repeat)


async def test_same_seed_replays_the_same_turns(real: RealGateway) -> None:
    messages = [{"role": "user", "content": "Say something surprising."}]
    sampled = []
    for rollout in ("seed-a", "seed-b"):
        await real.register(
            rollout, sampling_params={"temperature": 1.0, "max_tokens": 12, "seed": 99}
        )
        history = list(messages)
        for turn in range(2):
            r = await real.chat(rollout, {"messages": history})
            content = r.json()["choices"][0]["message"]["content"]
            history += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"More ({turn})."},
            ]
        steps = (await real.trajectory(rollout))["trajectory"]
        sampled.append([check_tokens(s)["completion_ids"] for s in steps])
    assert sampled[0] == sampled[1]  # reproducible from the registered seed
    direct = await real.engine.post(
        f"{real.engine_url}/chat/completions",
        json={
            "model": real.model,
            "messages": messages,
            "temperature": 1.0,
            "max_tokens": 12,
            "seed": 99,
            "return_token_ids": True,
        },
    )
    # Turn 1 did not sample with the registered seed itself: its own derived seed.
    assert direct.json()["choices"][0]["token_ids"] != sampled[0][0]


async def test_agent_fields_that_change_the_engine_input_are_not_forwarded(
    real: RealGateway,
) -> None:
    # truncate_prompt_tokens / echo / n would make the engine see or return something
    # other than what is recorded: the gateway's allowlist drops them, and the recorded
    # prompt ids are exactly the engine's rendering of the recorded messages.
    await real.register("fields", sampling_params={"max_tokens": 6})
    messages = [SYSTEM, {"role": "user", "content": "Describe the weather in detail please."}]
    r = await real.chat(
        "fields",
        {
            "messages": messages,
            "truncate_prompt_tokens": 5,
            "echo": True,
            "n": 3,
            "include_reasoning": False,
        },
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    step = (await real.trajectory("fields"))["trajectory"][0]
    assert check_tokens(step)["prompt_ids"] == await real.tokenize(messages)
    assert {"truncate_prompt_tokens", "echo", "n"} <= set(step["extras"]["dropped_fields"])
    # include_reasoning: false never costs the recorded tokens (vLLM withholds ids and
    # logprobs when it is false and a reasoning parser runs): upstream always gets true.
    assert step["tokens"] is not None


async def test_registered_n_records_every_choice(real: RealGateway) -> None:
    await real.register("n2", sampling_params={"n": 2, "temperature": 1.0, "max_tokens": 8})
    ask = {"messages": [{"role": "user", "content": "Pick a number."}], "return_token_ids": True}
    r = await real.chat("n2", ask)
    assert len(r.json()["choices"]) == 2
    step = (await real.trajectory("n2"))["trajectory"][0]
    (other,) = step["extras"]["other_choices"]
    check_tokens(step, other_tokens=len(other["completion_ids"]))
    assert other["completion_ids"] == r.json()["choices"][1]["token_ids"]
    assert len(other["completion_logprobs"]) == len(other["completion_ids"])


async def test_policy_version_and_unknown_model(real: RealGateway) -> None:
    await real.register("policy", sampling_params={"max_tokens": 4})
    await real.chat("policy", {"messages": [{"role": "user", "content": "a"}]})
    announced = await real.control.post("/v1/policy/version", json={"version": 3})
    assert announced.status_code == 200 and announced.json()["version"] == 3
    await real.chat(
        "policy",
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    )
    traj = await real.trajectory("policy")
    assert traj["policy_versions"] == [None, 3]

    await real.register("nomodel", model="no-such-model")
    r = await real.chat("nomodel", {"messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 404  # the engine's 404 stays a 404
    assert "does not exist" in r.json()["error"]["message"]


async def test_vllm_accepts_sglang_flags_harmlessly(real: RealGateway) -> None:
    body = {
        "model": real.model,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "max_tokens": 6,
        "return_token_ids": True,
        "logprobs": True,
    }
    url = f"{real.engine_url}/chat/completions"
    plain = (await real.engine.post(url, json=body)).json()
    sglang_flags = {"return_prompt_token_ids": True, "return_meta_info": True}
    both = await real.engine.post(url, json={**body, **sglang_flags})
    assert both.status_code == 200
    assert both.json()["prompt_token_ids"] == plain["prompt_token_ids"]
    assert both.json()["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


async def test_health_reports_the_engine(real: RealGateway) -> None:
    health = (await real.control.get("/health")).json()
    (upstream,) = health["upstreams"]
    assert upstream["engine"] == "vllm" and upstream["max_model_len"] == 4096
    await real.register("h", sampling_params={"max_tokens": 2})
    await real.chat("h", {"messages": [{"role": "user", "content": "a"}]})
    health = (await real.control.get("/health")).json()
    assert health["upstreams"][0]["token_ids"] is True and "warnings" not in health


def test_engine_url_is_reachable() -> None:
    assert httpx.get(f"{os.environ[URL_VAR]}/models", timeout=10).status_code == 200
