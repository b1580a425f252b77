"""verifiers v1's token limits at the gateway (server/state/limits_v1.py), counted as v1 counts."""

from __future__ import annotations

import pytest

from rollout_gateway.protocol import TURN_REFUSED_STATUS
from rollout_gateway.server.state.limits_v1 import TokenBudget

from ..conftest import GatewayHarness, script

PROMPT = [{"role": "user", "content": script({"say": "one two three"}, {"say": "four"})}]


def test_budget_counts_new_input_output_and_total_like_v1() -> None:
    budget = TokenBudget(max_total_tokens=100)
    budget.add_turn(prompt_tokens=10, completion_tokens=3)
    budget.add_turn(prompt_tokens=16, completion_tokens=2)  # 13 seen before: 3 new
    assert (budget.input_tokens, budget.output_tokens, budget.total_tokens) == (13, 5, 18)
    budget.add_turn(prompt_tokens=4, completion_tokens=1)  # history cut: never negative
    assert budget.input_tokens == 13


@pytest.mark.parametrize(
    ("caps", "used", "reached"),
    [
        ({"max_input_tokens": 10}, (10, 1), "max_input_tokens"),
        ({"max_output_tokens": 5}, (3, 5), "max_output_tokens"),
        ({"max_total_tokens": 8}, (5, 3), "max_total_tokens"),
        ({"max_total_tokens": 9}, (5, 3), None),
        ({"max_input_tokens": 10, "max_output_tokens": 1}, (10, 1), "max_input_tokens"),
    ],
)
def test_first_reached_cap_in_v1_order(caps, used, reached) -> None:
    budget = TokenBudget(**caps)
    budget.add_turn(*used)
    assert budget.reached() == reached


def test_a_budget_only_for_the_caps_a_register_body_sets() -> None:
    assert TokenBudget.from_limits({"model": "m", "max_input_tokens": None}) is None
    budget = TokenBudget.from_limits({"model": "m", "max_output_tokens": 5})
    assert budget == TokenBudget(max_output_tokens=5)


async def test_turn_past_a_v1_cap_is_refused_with_its_name(gw: GatewayHarness) -> None:
    assert (await gw.register("r1", max_output_tokens=1)).status_code == 200
    first = await gw.chat("r1", PROMPT)
    assert first.status_code == 200  # soft by one turn: the crossing turn completes
    history = [*PROMPT, first.json()["choices"][0]["message"], {"role": "user", "content": "go"}]
    refused = await gw.chat("r1", history)
    assert refused.status_code == TURN_REFUSED_STATUS
    assert refused.json()["error"]["code"] == "max_output_tokens_reached"
    body = (await gw.trajectory("r1")).json()
    assert body["truncation_reason"] == "max_output_tokens"
    assert body["num_turns"] == 1 and body["is_truncated"]


async def test_bad_limit_in_register_is_400(gw: GatewayHarness) -> None:
    r = await gw.register("r1", max_total_tokens=-5)
    assert r.status_code == 400
    assert "max_total_tokens" in r.json()["error"]["message"]


async def test_rollout_without_v1_caps_is_not_limited_by_them(gw: GatewayHarness) -> None:
    assert (await gw.register("r1")).status_code == 200
    assert gw.gateway.registry.get("r1").token_budget is None
    assert (await gw.chat("r1", PROMPT)).status_code == 200
