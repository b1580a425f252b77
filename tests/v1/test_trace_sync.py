"""Rebuilding a v1 trace from gateway steps (rollout_gateway.v1.trace_sync)."""

from __future__ import annotations

from typing import Any

import pytest
import verifiers.v1 as vf
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.task import TaskData
from verifiers.v1.trace import AgentInfo, TraceTask

from rollout_gateway.v1.trace_sync import TraceSync, TraceSyncError

SYSTEM = {"role": "system", "content": "sys"}
USER = {"role": "user", "content": "fix it"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "run_shell", "arguments": "{}"}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
ANSWER = {"role": "assistant", "content": "done"}


def new_trace() -> vf.Trace:
    return vf.Trace(
        task=TraceTask(type="T", data=TaskData(prompt="fix it")),
        agent=AgentInfo(config=AgentConfig(model="m")),
    )


def step(prompt: list[Any], answer: dict[str, Any], ids: list[int], out: list[int], **kw: Any):
    return {
        "prompt": prompt,
        "completion": [answer],
        "tokens": {
            "prompt_ids": ids,
            "completion_ids": out,
            "completion_logprobs": [-0.5 - i for i in range(len(out))],
        },
        "is_truncated": False,
        "extras": kw,
    }


def two_turns(second_prompt_ids: list[int]) -> list[dict[str, Any]]:
    return [
        step([SYSTEM, USER], CALL, [1, 2, 3], [4, 5]),
        step([SYSTEM, USER, CALL, RESULT], ANSWER, second_prompt_ids, [8, 9, 10]),
    ]


def test_extending_prompts_give_one_branch_equal_to_the_record() -> None:
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(
        two_turns([1, 2, 3, 4, 5, 6, 7])
    )
    assert trace.num_turns == 2 and trace.num_branches == 1
    branch = trace.branches[0]
    assert branch.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert branch.sampled_mask == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3
    sampled = [lp for lp, m in zip(branch.logprobs, branch.sampled_mask, strict=True) if m]
    assert sampled == [-0.5, -1.5, -0.5, -1.5, -2.5]
    assert [c.node is not None for c in trace.calls] == [True, True]
    assert [c.finish_reason for c in trace.calls] == ["tool_calls", "stop"]
    # Usage counted from the ids when the gateway reports none: v1's limits can use it.
    assert trace.num_output_tokens == 5
    assert trace.num_input_tokens == 3 + 2


def test_retokenized_history_forks_like_v1_would() -> None:
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(
        two_turns([1, 2, 3, 99, 5, 6, 7])
    )
    assert trace.num_branches == 2


def test_sync_is_incremental_each_step_committed_once() -> None:
    trace = new_trace()
    sync = TraceSync(trace, model="m", sampling=None, rollout_id="r")
    steps = two_turns([1, 2, 3, 4, 5, 6, 7])
    assert sync.apply(steps[:1]) == 1
    assert sync.apply(steps) == 1
    assert sync.apply(steps) == 0
    assert trace.num_turns == 2 and len(trace.calls) == 2


def test_gateway_facts_become_the_model_call() -> None:
    trace = new_trace()
    facts = {
        "finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "cached_tokens": 1,
        "timing": {"started_at": 1000.0, "first_token_s": 0.1, "upstream_s": 0.5},
        "sampling": {"temperature": 0.7, "max_tokens": 2},
    }
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(
        [step([SYSTEM, USER], ANSWER, [1, 2, 3], [4, 5], **facts)]
    )
    call = trace.calls[0]
    assert call.finish_reason == "length"
    assert call.usage is not None
    assert (call.usage.prompt_tokens, call.usage.cached_input_tokens) == (2, 1)
    assert (call.time.start, call.time.end) == (1000.0, 1000.5)
    assert call.sampling is not None and call.sampling.temperature == 0.7
    assert call.model == "m" and call.endpoint == "/chat/completions"


def test_a_failed_turn_is_a_call_with_its_error_and_no_node() -> None:
    trace = new_trace()
    failed = {
        "prompt": [SYSTEM, USER],
        "completion": [],
        "tokens": None,
        "is_truncated": True,
        "extras": {
            "status": "error",
            "error": {
                "type": "context_length_exceeded",
                "message": "too long",
                "status_code": 400,
            },
        },
    }
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply([failed])
    assert trace.num_turns == 0
    (call,) = trace.calls
    assert call.node is None and call.error is not None
    assert (call.error.type, call.error.status_code) == ("context_length_exceeded", 400)


def test_a_turn_without_an_assistant_message_is_refused() -> None:
    bad = step([SYSTEM, USER], {"role": "tool", "tool_call_id": "x", "content": "?"}, [1], [2])
    with pytest.raises(TraceSyncError):
        TraceSync(new_trace(), model="m", sampling=None, rollout_id="r").apply([bad])
