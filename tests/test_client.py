"""GatewayClient: retries on transient failures only, typed errors, register idempotence."""

from __future__ import annotations

import httpx
import pytest
import respx
from helpers import FAST_RETRY

from rollout_gateway import (
    GatewayClient,
    GatewayProtocolError,
    GatewayRequestError,
    GatewayUnavailableError,
    RetryPolicy,
    RolloutConflictError,
    RolloutNotFoundError,
)

ROOT = "http://gw.test:8000"
RID = "rollout_abc"
REGISTERED = {
    "rollout_id": RID,
    "status": "active",
    "model": "m",
    "max_turns": -1,
    "max_seq_len": None,
}


@pytest.fixture
async def client():
    async with GatewayClient(ROOT + "/v1", retry=FAST_RETRY, admin_token="adm") as c:
        yield c


@respx.mock
async def test_register_sends_the_protocol_body_and_admin_token(client):
    route = respx.post(f"{ROOT}/v1/rollouts/{RID}/register").respond(
        200, json={**REGISTERED, "api_key": "k1"}
    )
    answer = await client.register(RID, model="m", sampling_params={"temperature": 1.0})
    assert answer["api_key"] == "k1"
    request = route.calls.last.request
    assert request.headers["authorization"] == "Bearer adm"
    import json

    assert json.loads(request.content) == {
        "model": "m",
        "sampling_params": {"temperature": 1.0},
        "max_turns": -1,
        "max_seq_len": None,
    }


@pytest.mark.parametrize("status", [429, 502, 503, 504])
@respx.mock
async def test_transient_statuses_are_retried(client, status):
    route = respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").mock(
        side_effect=[httpx.Response(status), httpx.Response(200, json={"trajectory": []})]
    )
    assert (await client.get_trajectory(RID))["trajectory"] == []
    assert route.call_count == 2


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.ReadError("idle keep-alive connection closed by server"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
    ],
)
@respx.mock
async def test_transport_errors_are_retried(client, error):
    route = respx.post(f"{ROOT}/v1/rollouts/{RID}/unregister").mock(
        side_effect=[error, httpx.Response(200, json={"rollout_id": RID, "status": "active"})]
    )
    assert (await client.unregister(RID))["rollout_id"] == RID
    assert route.call_count == 2


@respx.mock
async def test_other_4xx_fail_fast_with_the_gateways_message(client):
    route = respx.post(f"{ROOT}/v1/rollouts/{RID}/register").respond(
        400, json={"error": {"message": "max_turns must be an integer", "type": "bad_request"}}
    )
    with pytest.raises(GatewayRequestError, match="max_turns must be an integer") as info:
        await client.register(RID, model="m")
    assert info.value.status_code == 400
    assert route.call_count == 1


@respx.mock
async def test_404_and_409_have_their_own_types(client):
    respx.post(f"{ROOT}/v1/rollouts/{RID}/cancel").respond(404, json={"detail": "unknown"})
    respx.post(f"{ROOT}/v1/rollouts/{RID}/register").respond(409, text="already registered")
    with pytest.raises(RolloutNotFoundError, match="unknown"):
        await client.cancel(RID)
    with pytest.raises(RolloutConflictError, match="already registered"):
        await client.register(RID, model="m")


@respx.mock
async def test_retried_register_answered_409_counts_as_success(client):
    route = respx.post(f"{ROOT}/v1/rollouts/{RID}/register").mock(
        side_effect=[httpx.ReadError("reset"), httpx.Response(409)]
    )
    answer = await client.register(RID, model="m", max_turns=5)
    assert answer["status"] == "active" and answer["max_turns"] == 5
    assert "api_key" not in answer
    assert route.call_count == 2


@respx.mock
async def test_retries_give_up_with_a_typed_retryable_error():
    policy = RetryPolicy(max_attempts=3, initial_backoff=0, max_backoff=0, jitter=0)
    route = respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").respond(503)
    async with GatewayClient(ROOT, retry=policy) as client:
        with pytest.raises(GatewayUnavailableError) as info:
            await client.get_trajectory(RID)
    assert info.value.retryable and info.value.status_code == 503
    assert route.call_count == 3


@respx.mock
async def test_non_json_or_malformed_answers_are_protocol_errors(client):
    respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").respond(200, text="<html>")
    with pytest.raises(GatewayProtocolError):
        await client.get_trajectory(RID)
    respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").respond(200, json={"trajectory": "x"})
    with pytest.raises(GatewayProtocolError):
        await client.get_trajectory(RID)


async def test_bad_rollout_ids_are_refused_before_any_request(client):
    with pytest.raises(ValueError, match="invalid rollout id"):
        await client.cancel("../admin")


async def test_close_is_idempotent():
    client = GatewayClient(ROOT)
    await client.aclose()
    await client.aclose()
    assert client.is_closed


def test_retry_policy_validates():
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


@respx.mock
async def test_retry_waits_grow_exponentially_through_the_sleep_seam():
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)

    policy = RetryPolicy(
        max_attempts=5, initial_backoff=0.1, max_backoff=0.3, jitter=0, sleep=record
    )
    route = respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").mock(
        side_effect=[httpx.Response(503)] * 4 + [httpx.Response(200, json={"trajectory": []})]
    )
    async with GatewayClient(ROOT, retry=policy) as client:
        assert await client.get_trajectory(RID) == {"trajectory": []}
    assert slept == pytest.approx([0.1, 0.2, 0.3, 0.3])  # doubled, capped at max_backoff
    assert route.call_count == 5


@respx.mock
async def test_a_single_attempt_policy_never_retries():
    route = respx.post(f"{ROOT}/v1/rollouts/{RID}/cancel").respond(503)
    async with GatewayClient(ROOT, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(GatewayUnavailableError):
            await client.cancel(RID)
    assert route.call_count == 1


FULL_STEPS = [
    {
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": [{"role": "assistant", "content": "a"}],
        "tokens": {
            "prompt_ids": [1, 2],
            "prompt_mask": [0, 0],
            "completion_ids": [3],
            "completion_mask": [1],
            "completion_logprobs": [-0.5],
            "overlong_prompt": False,
            "is_truncated": False,
        },
        "reward": None,
        "advantage": None,
        "is_truncated": False,
        "trajectory_id": "t",
        "extras": {},
    },
    {
        "prompt": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "more"},
        ],
        "completion": [{"role": "assistant", "content": "b"}],
        "tokens": {
            "prompt_ids": [1, 2, 3, 4],
            "prompt_mask": [0, 0, 0, 0],
            "completion_ids": [5, 6],
            "completion_mask": [1, 1],
            "completion_logprobs": [-0.1, -0.2],
            "overlong_prompt": False,
            "is_truncated": False,
        },
        "reward": None,
        "advantage": None,
        "is_truncated": False,
        "trajectory_id": "t",
        "extras": {"finish_reason": "stop"},
    },
]


@respx.mock
async def test_the_trajectory_is_asked_in_delta_form_and_expanded(client):
    from rollout_gateway.protocol import delta_steps

    route = respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").respond(
        200, json={"rollout_id": RID, "format": "delta", "trajectory": delta_steps(FULL_STEPS)}
    )
    answer = await client.get_trajectory(RID)
    assert route.calls.last.request.url.params["format"] == "delta"
    assert answer == {"rollout_id": RID, "trajectory": FULL_STEPS}


@respx.mock
async def test_a_gateway_without_the_delta_form_answers_the_full_one(client):
    respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").respond(
        200, json={"rollout_id": RID, "trajectory": FULL_STEPS}
    )
    assert (await client.get_trajectory(RID))["trajectory"] == FULL_STEPS


@respx.mock
async def test_a_malformed_delta_step_is_a_protocol_error(client):
    respx.get(f"{ROOT}/v1/rollouts/{RID}/trajectory").respond(
        200, json={"format": "delta", "trajectory": [{"prompt_shared": 0}]}
    )
    with pytest.raises(GatewayProtocolError, match="malformed delta"):
        await client.get_trajectory(RID)


async def test_a_gateway_under_a_path_prefix_gets_every_call_at_its_full_url():
    # The client builds absolute URLs itself (httpx parses one once); a gateway mounted
    # under a prefix, with query strings, must still get exactly the protocol's paths.
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={**REGISTERED, "api_key": "k1"})
        if request.url.path.endswith("/exits"):
            return httpx.Response(200, json={"exits": [], "cursor": 0})
        if request.url.path.endswith("/trajectory"):
            return httpx.Response(200, json={"trajectory": []})
        return httpx.Response(200, json={"rollout_id": RID, "status": "unregistered"})

    prefix = "http://gw.test:8000/team/gw"
    async with GatewayClient(
        prefix + "/v1/", transport=httpx.MockTransport(handler), retry=FAST_RETRY
    ) as client:
        await client.register(RID, model="m")
        await client.get_trajectory(RID)
        await client.wait_exits(3, 0.5)
        await client.unregister(RID)
    assert seen == [
        f"{prefix}/v1/rollouts/{RID}/register",
        f"{prefix}/v1/rollouts/{RID}/trajectory?format=delta",
        f"{prefix}/v1/rollouts/exits?after=3&timeout=0.5",
        f"{prefix}/v1/rollouts/{RID}/unregister",
    ]
