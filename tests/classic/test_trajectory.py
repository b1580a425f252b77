"""Gateway trajectory answer -> verifiers state."""

from __future__ import annotations

import pytest
import verifiers as vf
from helpers import tokens
from verifiers.types import RolloutTiming
from verifiers.utils.save_utils import state_to_output

from rollout_gateway import GatewayProtocolError
from rollout_gateway.classic.trajectory import apply_trajectory

USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "hello"}


def fresh_state() -> vf.State:
    state = vf.State(input={"prompt": [USER], "example_id": 3})
    fields = {
        "prompt": [vf.UserMessage(content="original")],
        "completion": None,
        "trajectory": [],
        "trajectory_id": "tid",
        "model": "m",
        "is_truncated": False,
        "timing": RolloutTiming(),
    }
    for key, value in fields.items():
        state[key] = value
    return state


def step(**overrides):
    base = {
        "prompt": [USER],
        "completion": [ANSWER],
        "tokens": tokens([1, 2], [3, 4, 5]),
        "reward": None,
        "advantage": None,
        "is_truncated": False,
        "trajectory_id": "gw-tid",
        "extras": {"history_rewritten": False},
    }
    base.update(overrides)
    return base


def test_steps_become_verifiers_steps_with_tokens_and_usage():
    state = fresh_state()
    steps = apply_trajectory(
        state, {"prompt": [USER], "completion": [ANSWER], "trajectory": [step()], "model": "gm"}
    )
    [converted] = steps
    assert converted["tokens"]["completion_ids"] == [3, 4, 5]
    assert converted["tokens"]["completion_mask"] == [1, 1, 1]
    assert converted["tokens"]["routed_experts"] is None
    assert converted["response"].usage.prompt_tokens == 2
    assert converted["response"].usage.completion_tokens == 3
    assert converted["response"].message.content == "hello"
    assert converted["response"].model == "gm"
    assert converted["trajectory_id"] == "gw-tid"
    assert converted["extras"] == {"history_rewritten": False}
    assert state["prompt"][0].content == "hi"


def test_missing_fields_never_erase_the_state():
    state = fresh_state()
    apply_trajectory(state, {"trajectory": [step(tokens=None)]})
    assert state["prompt"][0].content == "original"  # no "prompt" in the answer
    assert "gateway_completion" not in state
    assert state["trajectory"][0]["tokens"] is None
    assert state["trajectory"][0]["response"].usage is None
    before = state["trajectory"]
    apply_trajectory(state, {"status": "completed"})
    assert state["trajectory"] is before  # no "trajectory" in the answer
    assert state["gateway_status"] == "completed"


def test_truncation_is_only_raised():
    state = fresh_state()
    apply_trajectory(state, {"trajectory": [step(is_truncated=True)]})
    assert state["is_truncated"] is True
    assert state["trajectory"][0]["response"].message.finish_reason == "length"
    apply_trajectory(state, {"trajectory": [step()], "is_truncated": False})
    assert state["is_truncated"] is True


@pytest.mark.parametrize(
    "bad",
    [
        {"trajectory": "nope"},
        {"trajectory": [step(tokens={"prompt_ids": [1]})]},
        {"trajectory": [step(tokens={**tokens([1], [2, 3]), "completion_logprobs": [0.0]})]},
        {"trajectory": [step(prompt=[{"role": "alien", "content": "x"}])]},
        {"trajectory": [42]},
    ],
)
def test_malformed_answers_are_protocol_errors(bad):
    with pytest.raises(GatewayProtocolError):
        apply_trajectory(fresh_state(), bad)


def test_state_serializes_with_verifiers_output_format():
    state = fresh_state()
    tool_call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "run_shell", "arguments": "{}"},
    }
    call = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    apply_trajectory(
        state,
        {
            "prompt": [USER],
            "completion": [call, tool, ANSWER],
            "trajectory": [step(completion=[call]), step(prompt=[USER, call, tool])],
        },
    )
    state["completion"] = state["gateway_completion"]
    # Top-level messages are the steps' own objects, not converted a second time.
    assert state["completion"][0] is state["trajectory"][1]["prompt"][1]
    output = state_to_output(state, ["trajectory"])
    assert output["trajectory"][1]["tokens"]["completion_logprobs"] == [-0.5] * 3
    assert output["completion"][0]["tool_calls"]


def test_shared_history_is_converted_once_and_still_exact():
    from rollout_gateway.classic.trajectory import MessageCache

    cache = MessageCache()
    first = cache.convert([USER, ANSWER], "p")
    second = cache.convert([USER, ANSWER, {"role": "user", "content": "more"}], "p")
    assert second[0] is first[0] and second[1] is first[1]
    assert second[2].content == "more"
    prefix = cache.convert([USER], "p")  # a prefix keeps the longer history cached
    assert prefix[0] is first[0]
    assert cache.convert([USER, ANSWER, {"role": "user", "content": "more"}], "p")[2] is second[2]
    rewritten = cache.convert([{"role": "user", "content": "other"}], "p")
    assert rewritten[0].content == "other"  # history rewritten: nothing stale reused


def test_the_gateways_turn_facts_reach_the_state():
    state = fresh_state()
    steps = [
        step(extras={"finish_reason": "length", "policy_version": 3}),
        step(extras={"finish_reason": "stop", "policy_version": 3, "policy_version_end": 4}),
        step(extras={"finish_reason": "stop", "policy_version": 4}),
    ]
    converted = apply_trajectory(
        state,
        {"trajectory": steps, "truncation_reason": "max_turns", "model": "gm"},
    )
    # The engine's finish reason, not one guessed from the message.
    assert converted[0]["response"].message.finish_reason == "length"
    assert state["gateway_truncation_reason"] == "max_turns"
    assert state["policy_versions"] == [3, 3, 4]
    assert state["stale_turns"] == [0, 1]  # older than the latest, and one across an update


def test_no_policy_fields_without_versions():
    state = fresh_state()
    apply_trajectory(state, {"trajectory": [step()], "model": "gm"})
    assert "policy_versions" not in state and "gateway_truncation_reason" not in state


def test_a_steps_routed_experts_reach_the_trainer_as_verifiers_payload():
    # Token-in mode's MoE routing (router replay): the step's tokens carry it in verifiers
    # 0.3's RoutedExpertsPayload shape, which prime-rl's bridge for 0.3 envs reads.
    routing = {"data": "AAECAw==", "shape": [2, 1, 2], "start": 0, "dtype": "uint8"}
    state = fresh_state()
    [converted] = apply_trajectory(
        state,
        {"trajectory": [step(tokens={**tokens([1, 2], [3]), "routed_experts": routing})]},
    )
    assert converted["tokens"]["routed_experts"] == routing
    assert state["trajectory"][0]["tokens"]["routed_experts"] == routing


@pytest.mark.parametrize(
    ("reason", "truncated"),
    [("max_turns", False), ("max_completion_tokens", False), ("max_context", True), (None, True)],
)
def test_is_truncated_is_counted_as_cli_agent_env_counts_it(reason, truncated):
    # The turn limit and the completion budget do not truncate a rollout by themselves in
    # verifiers 0.3 (its stop names them); the context does (prompt_too_long). A gateway
    # that names no reason is taken at its word.
    state = fresh_state()
    apply_trajectory(
        state, {"trajectory": [step()], "is_truncated": True, "truncation_reason": reason}
    )
    assert state["is_truncated"] is truncated
