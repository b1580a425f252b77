"""Every row of the protocol table, success and failure, through the real ASGI app."""

from __future__ import annotations

import pytest

from rollout_gateway.protocol import new_rollout_id

from .conftest import GatewayHarness, script

MESSAGES = [{"role": "user", "content": script({"say": "hello"})}]


def assert_error(response, status: int, fragment: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["type"], str)
    assert fragment.lower() in error["message"].lower()


async def test_register_returns_protocol_body(gw: GatewayHarness) -> None:
    rid = new_rollout_id()
    r = await gw.register(rid, model="m", max_turns=4, max_seq_len=2048)
    assert r.status_code == 200
    answer = r.json()
    assert len(answer.pop("api_key")) >= 40  # per-rollout keys are on by default
    assert answer == {
        "rollout_id": rid,
        "status": "active",
        "model": "m",
        "max_turns": 4,
        "max_seq_len": 2048,
    }


async def test_register_twice_is_409(gw: GatewayHarness) -> None:
    assert (await gw.register("r1")).status_code == 200
    assert_error(await gw.register("r1"), 409, "already registered")


async def test_register_when_disabled_is_503(make_gateway) -> None:
    gw = await make_gateway(enabled=False)
    assert_error(await gw.register("r1"), 503, "disabled")


@pytest.mark.parametrize(
    "body",
    [
        {"sampling_params": {}},  # no model
        {"model": "m", "sampling_params": []},
        {"model": "m", "max_turns": "3"},
        {"model": "m", "max_turns": -5},
        {"model": "m", "max_seq_len": 0},
    ],
)
async def test_register_bad_body_is_400(gw: GatewayHarness, body) -> None:
    r = await gw.client.post("/v1/rollouts/r1/register", json=body)
    assert_error(r, 400)


async def test_register_malformed_json_is_400(gw: GatewayHarness) -> None:
    r = await gw.client.post("/v1/rollouts/r1/register", content=b"{not json")
    assert_error(r, 400, "malformed")


@pytest.mark.parametrize("method,suffix", [
    ("POST", "register"), ("POST", "chat/completions"), ("GET", "trajectory"),
    ("POST", "cancel"), ("POST", "unregister"),
])  # fmt: skip
async def test_bad_rollout_id_is_400(gw: GatewayHarness, method: str, suffix: str) -> None:
    for bad in ("bad%20id", "a.b", "x" * 129, "%C3%A9"):
        r = await gw.client.request(method, f"/v1/rollouts/{bad}/{suffix}", json={"model": "m"})
        assert_error(r, 400, "invalid rollout id")


async def test_chat_success(gw: GatewayHarness) -> None:
    await gw.register("r1")
    r = await gw.chat("r1", MESSAGES)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    # The agent did not ask for token fields: they are not echoed back.
    assert "prompt_token_ids" not in body
    assert "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None


async def test_chat_returns_token_fields_when_agent_asks(gw: GatewayHarness) -> None:
    await gw.register("r1")
    r = await gw.chat("r1", {"messages": MESSAGES, "return_token_ids": True, "logprobs": True})
    body = r.json()
    assert body["prompt_token_ids"] and body["choices"][0]["token_ids"]
    assert body["choices"][0]["logprobs"]["content"]


async def test_chat_unknown_rollout_is_404(gw: GatewayHarness) -> None:
    assert_error(await gw.chat("nobody", MESSAGES), 404, "not registered")


@pytest.mark.parametrize(
    "content,fragment",
    [
        (b"{oops", "malformed"),
        (b"", "json object"),
        (b"[1, 2]", "json object"),
        (b'{"model": "x"}', "messages"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [42]}', "message"),
    ],
)
async def test_chat_bad_request_is_400_and_server_keeps_serving(
    gw: GatewayHarness, content: bytes, fragment: str
) -> None:
    await gw.register("r1")
    r = await gw.client.post(
        "/v1/rollouts/r1/chat/completions", content=content, headers=gw.agent_headers("r1")
    )
    assert_error(r, 400, fragment)
    ok = await gw.chat("r1", MESSAGES)
    assert ok.status_code == 200
    # A rejected request is not a turn.
    assert (await gw.trajectory("r1")).json()["num_turns"] == 1


async def test_chat_oversized_body_is_413(make_gateway) -> None:
    gw = await make_gateway(max_body_bytes=1000)
    await gw.register("r1")
    big = [{"role": "user", "content": "x" * 2000}]
    assert_error(await gw.chat("r1", big), 413, "exceeds")

    async def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"messages": [{"role": "user", "content": "'
        yield b"y" * 2000
        yield b'"}]}'

    r = await gw.client.post(
        "/v1/rollouts/r1/chat/completions", content=chunked(), headers=gw.agent_headers("r1")
    )
    assert_error(r, 413)
    assert (await gw.chat("r1", MESSAGES)).status_code == 200


async def test_trajectory_and_404(gw: GatewayHarness) -> None:
    await gw.register("r1", model="m")
    await gw.chat("r1", MESSAGES)
    r = await gw.trajectory("r1")
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {
        "rollout_id", "status", "num_turns", "model", "prompt", "completion",
        "is_truncated", "trajectory", "truncation_reason", "abandoned_turns",
        "policy_versions", "failed_turns",
    }  # fmt: skip
    assert body["truncation_reason"] is None and body["policy_versions"] == [None]
    assert body["rollout_id"] == "r1" and body["status"] == "active"
    assert body["num_turns"] == 1 and body["model"] == "m"
    assert body["prompt"] == MESSAGES
    assert body["completion"] == [{"role": "assistant", "content": "hello"}]
    assert body["is_truncated"] is False
    assert_error(await gw.trajectory("other"), 404)


async def test_cancel_then_chat_is_refused_with_a_status_sdks_do_not_retry(
    gw: GatewayHarness,
) -> None:
    await gw.register("r1")
    await gw.chat("r1", MESSAGES)
    r = await gw.client.post("/v1/rollouts/r1/cancel")
    assert r.status_code == 200
    assert r.json() == {"rollout_id": "r1", "status": "cancelled"}
    refused = await gw.chat("r1", MESSAGES)
    assert_error(refused, 403, "cancelled")
    assert refused.json()["error"]["code"] == "rollout_cancelled"
    assert refused.headers["x-should-retry"] == "false"
    traj = (await gw.trajectory("r1")).json()
    assert traj["status"] == "cancelled" and traj["num_turns"] == 1
    assert_error(await gw.client.post("/v1/rollouts/nope/cancel"), 404)


async def test_unregister_frees_the_rollout(gw: GatewayHarness) -> None:
    await gw.register("r1")
    r = await gw.client.post("/v1/rollouts/r1/unregister")
    assert r.status_code == 200
    assert r.json() == {"rollout_id": "r1", "status": "active"}
    assert_error(await gw.chat("r1", MESSAGES), 404)
    assert_error(await gw.trajectory("r1"), 404)
    assert_error(await gw.client.post("/v1/rollouts/r1/unregister"), 404)
    assert len(gw.gateway.registry) == 0
    # The id can be registered again afterwards.
    assert (await gw.register("r1")).status_code == 200


async def test_max_turns_completes_the_rollout(gw: GatewayHarness) -> None:
    await gw.register("r1", max_turns=2)
    assert (await gw.chat("r1", MESSAGES)).status_code == 200
    assert (await gw.trajectory("r1")).json()["status"] == "active"
    assert (await gw.chat("r1", MESSAGES)).status_code == 200
    assert (await gw.trajectory("r1")).json()["status"] == "completed"
    refused = await gw.chat("r1", MESSAGES)
    assert_error(refused, 403, "turn limit")
    assert refused.json()["error"]["code"] == "max_turns_reached"
    traj = (await gw.trajectory("r1")).json()
    assert traj["is_truncated"] is True and traj["truncation_reason"] == "max_turns"
    assert traj["num_turns"] == 2
    r = await gw.client.post("/v1/rollouts/r1/unregister")
    assert r.json() == {"rollout_id": "r1", "status": "completed"}


async def test_max_turns_zero_refuses_first_turn(gw: GatewayHarness) -> None:
    await gw.register("r1", max_turns=0)
    assert_error(await gw.chat("r1", MESSAGES), 403)


async def test_unknown_route_is_json_404(gw: GatewayHarness) -> None:
    assert_error(await gw.client.get("/nope"), 404)
    assert_error(await gw.client.get("/v1/rollouts/r1/register"), 405)


async def test_health_and_metrics(gw: GatewayHarness) -> None:
    await gw.register("r1")
    await gw.chat("r1", MESSAGES)
    await gw.chat("nobody", MESSAGES)
    health = (await gw.client.get("/health")).json()
    assert health["status"] == "ok" and health["active_rollouts"] == 1
    assert health["upstreams"][0]["pinned"] == 1
    text = (await gw.client.get("/metrics")).text
    assert "rollout_gateway_active_rollouts 1" in text
    assert "rollout_gateway_registrations_total 1" in text
    assert 'rollout_gateway_turns_total{upstream="http://upstream-a/v1"} 1' in text
    assert 'rollout_gateway_upstream_latency_seconds_count{upstream="http://upstream-a/v1"} 1' in (
        text
    )
    assert 'rollout_gateway_rejected_requests_total{status="404"} 1' in text
    assert "rollout_gateway_expired_rollouts_total 0" in text
    assert "# TYPE rollout_gateway_upstream_errors_total counter" in text
