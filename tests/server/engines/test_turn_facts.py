"""What a step records about its turn: finish/stop reasons, usage, timing, sampling sent,
seeds, policy versions, sentinel logprobs, all choices, reasoning, context overflow."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_gateway.scripted import build_completion
from rollout_gateway.server.state.policy import PolicyClock, StaleVersionError
from rollout_gateway.server.turn_seed import turn_seed

from ..conftest import GatewayFactory

Answer = Callable[[dict[str, Any]], tuple[int, Any]]
HI = [{"role": "user", "content": "hi"}]


def vllm_like(answer: Answer, *, gate: asyncio.Event | None = None) -> tuple[Starlette, list]:
    """A vLLM-shaped upstream (``owned_by: vllm``) answering with ``answer(body)``."""
    bodies: list[dict[str, Any]] = []

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        bodies.append(body)
        if gate is not None:
            await gate.wait()
        status, payload = answer(body)
        return JSONResponse(payload, status_code=status)

    async def models(request: Request) -> Response:
        card = {"id": "m", "owned_by": "vllm", "max_model_len": 2048}
        return JSONResponse({"object": "list", "data": [card]})

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )
    return app, bodies


def scripted(**choice_overrides: Any) -> Answer:
    """The scripted model's answer, with fields of choice 0 replaced."""

    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        completion = build_completion(body, "m")
        completion["choices"][0].update(choice_overrides)
        return 200, completion

    return answer


async def test_step_records_finish_stop_usage_timing_and_sampling(
    make_gateway: GatewayFactory,
) -> None:
    app, bodies = vllm_like(scripted(stop_reason=257))
    gw = await make_gateway(app)
    reg = await gw.register("r1", sampling_params={"temperature": 0.5, "seed": 42})
    assert reg.json()["max_seq_len"] == 2048  # the engine's max_model_len
    for _ in range(2):
        assert (await gw.chat("r1", HI)).status_code == 200
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    for turn, step in enumerate(steps):
        extras = step["extras"]
        assert extras["finish_reason"] == "stop" and extras["stop_reason"] == 257
        assert extras["usage"]["completion_tokens"] == len(step["tokens"]["completion_ids"])
        assert extras["timing"]["upstream_s"] >= 0 and extras["timing"]["started_at"] > 0
        # The sampling actually sent: the registered temperature, the turn's own seed.
        sent = {k: bodies[turn][k] for k in ("temperature", "seed")}
        assert extras["sampling"] == sent
        # Nobody set a completion bound: none is sent (the engine gives what its
        # context leaves), and the step says the agent asked for none.
        assert "max_tokens" not in bodies[turn] and extras["agent_sampling"] == {}
        assert sent["temperature"] == 0.5 and sent["seed"] == turn_seed(42, turn)
        assert bodies[turn]["seed"] == turn_seed(42, turn)
        assert bodies[turn]["include_reasoning"] is True  # tokens whatever the agent asks
    assert steps[0]["extras"]["sampling"]["seed"] != steps[1]["extras"]["sampling"]["seed"]


def test_turn_seeds_are_distinct_and_reproducible() -> None:
    seeds = [turn_seed(7, i) for i in range(100)]
    assert len(set(seeds)) == 100 and seeds == [turn_seed(7, i) for i in range(100)]
    assert all(0 <= s < 2**31 for s in seeds) and turn_seed(8, 0) != turn_seed(7, 0)


@pytest.mark.parametrize("reason", ["abort", "repetition", "length"])
async def test_cut_samples_are_truncated(make_gateway: GatewayFactory, reason: str) -> None:
    gw = await make_gateway(vllm_like(scripted(finish_reason=reason))[0])
    await gw.register("r1")
    await gw.chat("r1", HI)
    traj = (await gw.trajectory("r1")).json()
    step = traj["trajectory"][0]
    assert step["is_truncated"] is True and step["tokens"]["is_truncated"] is True
    assert step["extras"]["finish_reason"] == reason and traj["is_truncated"] is True


async def test_sentinel_logprobs_are_flagged(make_gateway: GatewayFactory) -> None:
    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        completion = build_completion(body, "m")
        completion["choices"][0]["logprobs"]["content"][1]["logprob"] = -9999.0
        return 200, completion

    gw = await make_gateway(vllm_like(answer)[0])
    await gw.register("r1")
    await gw.chat("r1", HI)
    step = (await gw.trajectory("r1")).json()["trajectory"][0]
    assert step["extras"]["logprob_sentinels"] == [1]
    assert step["tokens"]["completion_logprobs"][1] == -9999.0  # kept as sent, flagged


async def test_every_choice_of_an_n_answer_is_recorded(make_gateway: GatewayFactory) -> None:
    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        completion = build_completion(body, "m")
        second = json.loads(json.dumps(completion["choices"][0]))
        second["index"] = 1
        second["token_ids"] = second["token_ids"][:2]
        second["logprobs"]["content"] = second["logprobs"]["content"][:2]
        second["finish_reason"] = "length"
        completion["choices"].append(second)
        return 200, completion

    gw = await make_gateway(vllm_like(answer)[0])
    await gw.register("r1", sampling_params={"n": 2})
    r = await gw.chat("r1", HI)
    assert len(r.json()["choices"]) == 2
    step = (await gw.trajectory("r1")).json()["trajectory"][0]
    (other,) = step["extras"]["other_choices"]
    assert other["index"] == 1 and other["finish_reason"] == "length"
    assert len(other["completion_ids"]) == len(other["completion_logprobs"]) == 2


async def test_reasoning_is_recorded_under_both_names(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway(vllm_like(scripted())[0])

    def with_reasoning(body: dict[str, Any]) -> tuple[int, Any]:
        completion = build_completion(body, "m")
        completion["choices"][0]["message"]["reasoning"] = "let me think"
        return 200, completion

    gw = await make_gateway(vllm_like(with_reasoning)[0])
    await gw.register("r1")
    shown = await gw.chat("r1", {"model": "a", "messages": HI})
    hidden = await gw.chat("r1", {"model": "a", "messages": HI, "include_reasoning": False})
    assert shown.json()["choices"][0]["message"]["reasoning"] == "let me think"
    assert "reasoning" not in hidden.json()["choices"][0]["message"]  # as the agent asked
    for step in (await gw.trajectory("r1")).json()["trajectory"]:
        message = step["completion"][0]
        assert message["reasoning"] == message["reasoning_content"] == "let me think"
        assert step["tokens"] is not None


VLLM_OVERFLOW = (
    "This model's maximum context length is 2048 tokens. However, your prompt contains at "
    "least 2049 input tokens, which exceeds this limit even without any output tokens."
)
SGLANG_OVERFLOW = "The input (3000 tokens) is longer than the model's context length (2048 tokens)."


@pytest.mark.parametrize("message", [VLLM_OVERFLOW, SGLANG_OVERFLOW])
async def test_context_overflow_is_recorded_and_ends_the_rollout(
    make_gateway: GatewayFactory, message: str
) -> None:
    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        if len(body["messages"]) > 1:
            error = {"message": message, "type": "BadRequestError", "code": 400}
            return 400, {"error": error}
        return scripted()(body)

    gw = await make_gateway(vllm_like(answer)[0])
    await gw.register("r1")
    assert (await gw.chat("r1", HI)).status_code == 200
    long = [*HI, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y" * 99}]
    r = await gw.chat("r1", long)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "rollout is over" in err["message"]
    later = await gw.chat("r1", HI)
    assert later.status_code == 403 and later.json()["error"]["code"] == "rollout_completed"
    # The rollout is over: the env hears it on the exit channel (the first refusal's why).
    exits = (await gw.client.get("/v1/rollouts/exits", params={"after": 0})).json()["exits"]
    assert [(e["rollout_id"], e["refused"]) for e in exits] == [("r1", "context_length_exceeded")]

    traj = (await gw.trajectory("r1")).json()
    assert traj["is_truncated"] is True and traj["status"] == "completed"
    assert traj["truncation_reason"] == "context_length_exceeded"
    assert traj["num_turns"] == len(traj["trajectory"]) == 2
    step = traj["trajectory"][1]
    assert step["prompt"] == long and step["completion"] == [] and step["tokens"] is None
    assert step["is_truncated"] is True
    assert step["extras"]["status"] == "error"
    assert step["extras"]["error"]["type"] == "context_length_exceeded"


async def test_other_upstream_4xx_are_not_recorded_and_404_stays_404(
    make_gateway: GatewayFactory,
) -> None:
    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        return 404, {"error": {"message": "The model `x` does not exist.", "code": 404}}

    gw = await make_gateway(vllm_like(answer)[0])
    await gw.register("r1", model="x")
    r = await gw.chat("r1", HI)
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    traj = (await gw.trajectory("r1")).json()
    assert traj["trajectory"] == [] and traj["status"] == "active"


async def test_policy_versions_stamp_turns_and_flag_a_turn_spanning_an_update(
    make_gateway: GatewayFactory,
) -> None:
    gate = asyncio.Event()
    gate.set()
    app, _ = vllm_like(scripted(), gate=gate)
    gw = await make_gateway(app)
    await gw.register("r1")
    await gw.chat("r1", HI)  # no version announced yet
    r = await gw.client.post("/v1/policy/version", json={"version": 5})
    assert r.status_code == 200 and r.json()["version"] == 5
    await gw.chat("r1", [*HI, {"role": "assistant", "content": "a"}])

    gate.clear()  # the next turn is in flight while the trainer loads version 6
    turn = asyncio.create_task(gw.chat("r1", [*HI, {"role": "assistant", "content": "b"}]))
    await asyncio.sleep(0.05)
    assert (await gw.client.post("/v1/policy/version", json={"version": 6})).status_code == 200
    gate.set()
    assert (await turn).status_code == 200  # neither lost...

    traj = (await gw.trajectory("r1")).json()
    assert traj["policy_versions"] == [None, 5, 5]
    extras = [s["extras"] for s in traj["trajectory"]]
    assert "policy_version_end" not in extras[1]
    assert extras[2]["policy_version_end"] == 6  # ...nor silently mixed

    # Versions move forward only; the admin token is required.
    stale = await gw.client.post("/v1/policy/version", json={"version": 4})
    assert stale.status_code == 409
    bad = await gw.client.post("/v1/policy/version", json={"version": "7"})
    assert bad.status_code == 400
    anonymous = await gw.client.post(
        "/v1/policy/version", json={"version": 9}, headers={"Authorization": "Bearer nope"}
    )
    assert anonymous.status_code == 401
    assert (await gw.client.get("/v1/policy/version")).json()["version"] == 6


def test_policy_clock() -> None:
    clock = PolicyClock(wall_clock=lambda: 123.0)
    assert clock.stamp("17") == 17 and clock.stamp("default") is None  # engine's own
    clock.announce(2)
    clock.announce(2)  # idempotent
    assert (clock.version, clock.updated_at, clock.epoch) == (2, 123.0, 1)
    assert clock.stamp("17") == 2  # the announced version wins
    with pytest.raises(StaleVersionError):
        clock.announce(1)


async def test_failed_engine_calls_are_listed_not_recorded_as_steps(
    make_gateway: GatewayFactory,
) -> None:
    calls = []

    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        calls.append(body)
        if len(calls) == 2:
            return 503, {"error": {"message": "engine overloaded", "code": 503}}
        return scripted()(body)

    gw = await make_gateway(vllm_like(answer)[0])
    await gw.register("r1")
    assert (await gw.chat("r1", HI)).status_code == 200
    failed = await gw.chat("r1", [*HI, {"role": "assistant", "content": "a"}])
    assert failed.status_code == 502
    traj = (await gw.trajectory("r1")).json()
    assert len(traj["trajectory"]) == traj["num_turns"] == 1
    (entry,) = traj["failed_turns"]
    assert entry["after_steps"] == 1
    assert entry["error"] == {
        "type": "http_5xx",
        "message": "upstream error 503",
        "status_code": 502,  # what the agent got
        "upstream_status": 503,  # what the engine said (verifiers v1 records this one)
    }
    assert entry["timing"]["upstream_s"] >= 0
