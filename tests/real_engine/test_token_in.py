"""Token-in mode in front of the real vLLM: the gateway renders and bridges every turn
(``renderers`` + the template-bridge renderer for the recipe's Gemma 3 template) and
samples through ``/inference/v1/generate`` (vLLM started with ``--enable-scale-out``, as
``.ci/run`` does). A multi-turn tool rollout is ONE v1 branch whose ids are exactly the
ids sent and sampled.

Needs the ``[tito]`` extra (skipped without it, saying so); the v1 trace check also
needs verifiers 0.4 (``.ci/run`` runs this file in the v1 venv).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("renderers", reason="token-in mode needs the [tito] extra (renderers)")
pytest.importorskip("transformers", reason="token-in mode needs the [tito] extra (transformers)")

from stacks import STACK  # noqa: E402
from support.tools import RUN_SHELL_TOOL, run_shell_call  # noqa: E402

from rollout_gateway.cli import served_model_path  # noqa: E402

from .conftest import URL_VAR, RealGateway, real_gateway  # noqa: E402

RENDERER = "rollout_gateway.server.template_bridge:end_of_turn_pythonic"
TOOLS = [RUN_SHELL_TOOL]


# A history that already holds assistant tool calls and their results.
START = [
    {"role": "system", "content": "You are a careful assistant with a shell."},
    {"role": "user", "content": "Find the bug. List the files first."},
    run_shell_call("call_0", "ls"),
    {"role": "tool", "tool_call_id": "call_0", "content": "main.py\nutils.py"},
    run_shell_call("call_1", "cat main.py"),
    {"role": "tool", "tool_call_id": "call_1", "content": "import utils\nprint(utils.add(1, 2))"},
]


@pytest.fixture
async def tito() -> AsyncIterator[RealGateway]:
    tokenizer = served_model_path(os.environ[URL_VAR].rstrip("/"))
    assert tokenizer, "the engine's /v1/models names no local model directory"
    async with real_gateway(
        upstream_mode="token-in", tokenizer=tokenizer, renderer=RENDERER
    ) as gateway:
        yield gateway


async def test_tool_rollout_is_one_branch_with_the_ids_sent_and_sampled(
    tito: RealGateway,
) -> None:
    await tito.register(
        "tito", sampling_params={"temperature": 0.8, "seed": 4321, "max_tokens": 24}
    )
    messages = [dict(m) for m in START]
    answers = []
    for turn in range(4):
        body = {"messages": messages, "tools": TOOLS, "return_token_ids": True, "logprobs": True}
        r = await tito.chat("tito", body)
        assert r.status_code == 200, r.text  # a 502 naming --enable-scale-out: see .ci/run
        answer = r.json()
        answers.append(answer)
        message = answer["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        echoed = {"role": "assistant", "content": message.get("content") or ""}
        if calls:
            echoed["tool_calls"] = calls
        messages.append(echoed)
        if calls:
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls]
        else:
            messages.append({"role": "user", "content": f"Go on ({turn})."})

    steps = (await tito.trajectory("tito"))["trajectory"]
    assert len(steps) == 4
    for step, answer in zip(steps, answers, strict=True):
        t, choice = step["tokens"], answer["choices"][0]
        assert t["prompt_ids"] == answer["prompt_token_ids"]  # the ids the gateway sent
        assert t["completion_ids"] == choice["token_ids"]  # the ids the engine sampled
        assert t["completion_logprobs"] == pytest.approx(
            [e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-6
        )
        assert all(math.isfinite(x) and x <= 0 for x in t["completion_logprobs"])
        assert step["extras"]["usage"]["prompt_tokens"] == len(t["prompt_ids"])
    # Turn 1 is rendered by the gateway exactly as the engine renders it itself.
    assert steps[0]["tokens"]["prompt_ids"] == await tito.tokenize(steps[0]["prompt"], TOOLS)
    # Every later turn is bridged onto the sampled ids: one sequence, no prefix break.
    assert [s["extras"]["bridged"] for s in steps] == [False, True, True, True]
    assert [s["extras"]["prefix_break"] for s in steps[1:]] == [False, False, False]
    for prev, step in zip(steps, steps[1:], strict=False):
        before = prev["tokens"]["prompt_ids"] + prev["tokens"]["completion_ids"]
        assert step["tokens"]["prompt_ids"][: len(before)] == before

    if STACK != "v1":
        return  # the branch count below needs verifiers 0.4 (.ci/run: the v1 venv)
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.task import TaskData
    from verifiers.v1.trace import AgentInfo, TraceTask

    from rollout_gateway.v1.trace_sync import TraceSync

    trace = vf.Trace(
        task=TraceTask(type="tito", data=TaskData(prompt="tito")),
        agent=AgentInfo(config=AgentConfig(model=tito.model)),
    )
    TraceSync(trace, model=tito.model, sampling=None, rollout_id="tito").apply(steps)
    assert trace.num_turns == 4 and len(trace.branches) == 1
    branch = trace.branches[0]
    last = steps[-1]["tokens"]
    assert branch.token_ids == last["prompt_ids"] + last["completion_ids"]
    sampled = sum(len(s["tokens"]["completion_ids"]) for s in steps)
    assert sum(branch.sampled_mask) == sampled


async def test_streamed_token_in_answer_matches_the_record(tito: RealGateway) -> None:
    await tito.register("stream", sampling_params={"temperature": 0, "max_tokens": 12})
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "stream": True}
    r = await tito.chat("stream", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in events[:-1]
        for choice in json.loads(event)["choices"]
    )
    steps = (await tito.trajectory("stream"))["trajectory"]
    assert len(steps) == 1 and steps[0]["tokens"]["completion_ids"]
    assert text == (steps[0]["completion"][0]["content"] or "")
