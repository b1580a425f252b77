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


def answer(steps: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A trajectory answer (the full form) holding ``steps``."""
    return {"trajectory": steps, **fields}


def two_turns(second_prompt_ids: list[int]) -> list[dict[str, Any]]:
    return [
        step([SYSTEM, USER], CALL, [1, 2, 3], [4, 5]),
        step([SYSTEM, USER, CALL, RESULT], ANSWER, second_prompt_ids, [8, 9, 10]),
    ]


def test_extending_prompts_give_one_branch_equal_to_the_record() -> None:
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(
        answer(two_turns([1, 2, 3, 4, 5, 6, 7]))
    )
    assert trace.num_turns == 2 and trace.num_branches == 1
    branch = trace.branches[0]
    assert list(branch.token_ids) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert list(branch.sampled_mask) == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3
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
        answer(two_turns([1, 2, 3, 99, 5, 6, 7]))
    )
    assert trace.num_branches == 2


def test_sync_is_incremental_each_step_committed_once() -> None:
    trace = new_trace()
    sync = TraceSync(trace, model="m", sampling=None, rollout_id="r")
    steps = two_turns([1, 2, 3, 4, 5, 6, 7])
    assert sync.apply(answer(steps[:1])) == 1
    assert sync.apply(answer(steps)) == 1
    assert sync.apply(answer(steps)) == 0
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
        answer([step([SYSTEM, USER], ANSWER, [1, 2, 3], [4, 5], **facts)])
    )
    call = trace.calls[0]
    assert call.finish_reason == "length"
    assert call.usage is not None
    assert (call.usage.prompt_tokens, call.usage.cached_input_tokens) == (2, 1)
    assert (call.time.start, call.time.end) == (1000.0, 1000.5)
    assert call.sampling is not None and call.sampling.temperature == 0.7
    assert call.model == "m" and call.endpoint == "/chat/completions"


@pytest.mark.parametrize(
    ("dialect", "endpoint"),
    [("chat", "/chat/completions"), ("anthropic", "/v1/messages"), ("responses", "/responses")],
)
def test_each_call_records_the_provider_path_of_its_turns_dialect(
    dialect: str, endpoint: str
) -> None:
    from verifiers.v1.dialects import DIALECTS

    # What v1's own interception records for a turn of that dialect (upstream_path).
    assert endpoint in {d.upstream_path for d in DIALECTS}
    trace = new_trace()
    sync = TraceSync(trace, model="m", sampling=None, rollout_id="r")
    steps = two_turns([1, 2, 3, 4, 5, 6, 7])
    for s in steps:
        s["extras"]["dialect"] = dialect
    outage = [failed(2, 10.0, type="connect", message="unreachable", status_code=502)]
    sync.apply(answer(steps, failed_turns=outage))
    # The failed call (no dialect on its record) took the dialect of the turns before it.
    assert [c.endpoint for c in trace.calls] == [endpoint] * 3


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
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(answer([failed]))
    assert trace.num_turns == 0
    (call,) = trace.calls
    assert call.node is None and call.error is not None
    # As v1's own client records the engine's 400 for a prompt that does not fit.
    assert (call.error.type, call.error.status_code) == ("ProviderError", 400)
    assert "too long" in call.error.message


def test_a_turn_without_an_assistant_message_is_refused() -> None:
    bad = step([SYSTEM, USER], {"role": "tool", "tool_call_id": "x", "content": "?"}, [1], [2])
    with pytest.raises(TraceSyncError):
        TraceSync(new_trace(), model="m", sampling=None, rollout_id="r").apply(answer([bad]))


def committed_like_v1s_server(steps: list[dict[str, Any]]) -> vf.Trace:
    """What v1's own server commits for these exchanges: ``prepare_turn`` on each request's
    parsed messages, then ``commit`` (its per-turn path, no shortcut)."""
    from verifiers.v1 import graph
    from verifiers.v1.dialects.chat import ChatDialect, parse_message
    from verifiers.v1.types import Response, TurnTokens

    trace = new_trace()
    for i, s in enumerate(steps):
        request = ChatDialect().parse_request({"messages": s["prompt"]})
        tokens = s["tokens"]
        turn = graph.prepare_turn(trace, request.messages, request.tools)
        turn.commit(
            Response(
                id=str(i),
                created=0,
                model="m",
                message=parse_message(s["completion"][0]),
                finish_reason="stop",
                tokens=TurnTokens(
                    prompt_ids=tokens["prompt_ids"],
                    completion_ids=tokens["completion_ids"],
                    completion_logprobs=tokens["completion_logprobs"],
                ),
            )
        )
    return trace


def long_rollout(turns: int) -> list[dict[str, Any]]:
    """``turns`` tool-calling turns whose prompts extend each other, messages and ids."""
    history: list[dict[str, Any]] = [SYSTEM, USER]
    ids: list[int] = [1, 2, 3]
    steps = []
    for t in range(turns):
        call_id = f"c{t}"
        call = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": f'{{"i": {t}}}'},
                }
            ],
        }
        out = [100 + t, 200 + t]
        steps.append(step(list(history), call, list(ids), out))
        result = {"role": "tool", "tool_call_id": call_id, "content": f"out {t}"}
        history += [call, result]
        ids += [*out, 300 + t]
    return steps


def nodes_of(trace: vf.Trace) -> list[tuple[Any, ...]]:
    # Lists: later verifiers store token streams as numpy arrays.
    return [
        (n.parent, n.message, list(n.token_ids), list(n.mask), list(n.logprobs))
        for n in trace.nodes
    ]


def test_replay_commits_the_graph_v1s_server_commits() -> None:
    # The replay hands commit the previous path instead of re-walking the history with
    # prepare_turn: it must give the very graph v1's own per-turn path gives.
    steps = long_rollout(6)
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(answer(steps))
    reference = committed_like_v1s_server(steps)
    assert nodes_of(trace) == nodes_of(reference)
    assert trace.num_branches == reference.num_branches == 1
    assert list(trace.branches[0].token_ids) == list(reference.branches[0].token_ids)
    # Tool results carry the name of the call they answer, as v1's dialect fills it in.
    tool_nodes = [n.message for n in trace.nodes if n.message.role == "tool"]
    assert tool_nodes and all(m.name == "run_shell" for m in tool_nodes)


def test_the_delta_form_gives_the_same_trace_as_the_full_form() -> None:
    from rollout_gateway.protocol import delta_steps

    steps = long_rollout(4)
    full, delta = new_trace(), new_trace()
    TraceSync(full, model="m", sampling=None, rollout_id="r").apply(answer(steps))
    complete = [{**s, "trajectory_id": "t", "reward": None, "advantage": None} for s in steps]
    for s in complete:
        s["tokens"] = {**s["tokens"], "overlong_prompt": False, "is_truncated": False}
    TraceSync(delta, model="m", sampling=None, rollout_id="r").apply(
        {"format": "delta", "trajectory": delta_steps(complete)}
    )
    assert nodes_of(full) == nodes_of(delta)


def failed(after: int, started: float, **error: Any) -> dict[str, Any]:
    return {
        "after_steps": after,
        "error": error,
        "timing": {"started_at": started, "upstream_s": 0.25},
    }


def test_failed_engine_calls_are_calls_with_v1s_provider_error_in_order() -> None:
    steps = long_rollout(2)
    outage = [
        failed(1, 10.0, type="connect", message="upstream unreachable", status_code=502),
        failed(1, 11.0, type="timeout", message="upstream timed out", status_code=502),
        failed(2, 12.0, type="http_5xx", message="upstream error 500", status_code=502,
               upstream_status=500),
    ]  # fmt: skip
    trace = new_trace()
    sync = TraceSync(trace, model="m", sampling=None, rollout_id="r")
    sync.apply(answer(steps, failed_turns=outage))
    kinds = [(c.node is not None, c.error.status_code if c.error else None) for c in trace.calls]
    # v1's own client: 503 for a connection failure, 504 for a timeout, the engine's own
    # status for its error answer; each failed exchange one call, where it happened.
    assert kinds == [(True, None), (False, 503), (False, 504), (True, None), (False, 500)]
    assert {c.error.type for c in trace.calls if c.error} == {"ProviderError"}
    assert [c.time.start for c in trace.calls if c.error] == [10.0, 11.0, 12.0]
    assert (trace.calls[1].time.end - trace.calls[1].time.start) == 0.25
    # The latest exchange failed: what v1's server leaves on session.error.
    assert sync.last_failure is not None and sync.last_failure.status_code == 500
    # Fetched again (the gateway lists them all each time): each recorded once.
    sync.apply(answer(steps, failed_turns=outage))
    assert len(trace.calls) == 5


def test_an_answered_turn_after_a_failure_clears_the_session_error() -> None:
    steps = long_rollout(2)
    sync = TraceSync(new_trace(), model="m", sampling=None, rollout_id="r")
    sync.apply(answer(steps[:1], failed_turns=[failed(1, 1.0, type="connect", message="x")]))
    assert sync.last_failure is not None and sync.last_failure.status_code == 503
    sync.apply(answer(steps, failed_turns=[failed(1, 1.0, type="connect", message="x")]))
    assert sync.last_failure is None


def test_nodes_carry_the_time_their_turn_was_answered_not_the_replay_time() -> None:
    steps = long_rollout(3)
    for t, s in enumerate(steps):
        s["extras"]["timing"] = {"started_at": 1000.0 + 10 * t, "upstream_s": 2.0}
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(answer(steps))
    sampled = [n.timestamp for n in trace.nodes if n.sampled]
    assert sampled == [1002.0, 1012.0, 1022.0]
    # A turn's new input nodes are created with its answer, as v1 stamps them at commit.
    assert trace.nodes[0].timestamp == 1002.0 and trace.nodes[-2].timestamp == 1022.0
    assert [c.time.start for c in trace.calls] == [1000.0, 1010.0, 1020.0]


def test_routed_experts_of_each_turn_land_on_the_branch_aligned_to_its_tokens() -> None:
    import base64

    import numpy as np

    layers, top_k = 3, 2

    def routing(tokens: list[int], start: int) -> dict[str, Any]:
        # vLLM's answer (prime-rl's serving): one row per position from ``start``, but for
        # the last completion token (no forward pass ran on it).
        rows = np.array([[[t % 256] * top_k] * layers for t in tokens[start:-1]], dtype=np.uint8)
        data = base64.b64encode(rows.tobytes()).decode()
        return {"data": data, "shape": list(rows.shape), "start": start, "dtype": "uint8"}

    steps = long_rollout(3)
    previous = 0
    for s in steps:
        t = s["tokens"]
        full = t["prompt_ids"] + t["completion_ids"]
        # A bridged turn asks for routing from the previous turn's last position (the
        # gateway's token-in mode, as v1's TrainClient: its row had no forward pass).
        t["routed_experts"] = routing(full, max(previous - 1, 0))
        previous = len(full)
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(answer(steps))
    (branch,) = trace.branches
    experts = branch.routed_experts
    assert experts is not None and experts.shape == (len(branch.token_ids), layers, top_k)
    # Every position but the very last has the routing of its own token.
    assert [int(row[0][0]) for row in experts[:-1]] == [t % 256 for t in branch.token_ids[:-1]]


def test_the_steps_alone_are_still_taken_as_earlier_versions_took_them() -> None:
    steps = long_rollout(2)
    by_steps, by_answer = new_trace(), new_trace()
    TraceSync(by_steps, model="m", sampling=None, rollout_id="r").apply(steps)
    TraceSync(by_answer, model="m", sampling=None, rollout_id="r").apply(answer(steps))
    assert nodes_of(by_steps) == nodes_of(by_answer)


def test_the_agents_tools_sent_once_in_the_delta_form_hold_for_every_step() -> None:
    # The gateway records each turn's tools; its delta form sends them on the first step
    # and when they change (protocol.StepExtras.tools). Carried forward, the turns still
    # extend one path: one branch, with the agent's tools on the trace.
    from rollout_gateway.protocol import delta_steps

    tools = [{"type": "function", "function": {"name": "run_shell", "parameters": {}}}]
    steps = [
        step([SYSTEM, USER], CALL, [1, 2, 3], [4, 5], tools=tools),
        step([SYSTEM, USER, CALL, RESULT], ANSWER, [1, 2, 3, 4, 5, 6, 7], [8, 9], tools=tools),
    ]
    for s in steps:  # the full form's remaining fields
        s.update(trajectory_id="t", reward=None, advantage=None)
        s["tokens"] = {**s["tokens"], "overlong_prompt": False, "is_truncated": False}
    delta = delta_steps(steps)
    assert "tools" in delta[0]["extras"] and "tools" not in delta[1]["extras"]
    trace = new_trace()
    TraceSync(trace, model="m", sampling=None, rollout_id="r").apply(
        {"format": "delta", "trajectory": delta}
    )
    assert trace.num_branches == 1
    assert [tool.name for tool in trace.tools] == ["run_shell"]
