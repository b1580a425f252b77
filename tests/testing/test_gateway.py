"""The fake gateway is the reference gateway: what an env meets through it is what it
meets through a served gateway, and the faults it injects are the transport's only."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from rollout_gateway.client import GatewayClient, RetryPolicy
from rollout_gateway.errors import GatewayRequestError, GatewayUnavailableError
from rollout_gateway.exits import ExitWatcher
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.testing import ENGINE_URL, FakeGateway

NO_RETRY = RetryPolicy(max_attempts=1)
TURN = [{"role": "user", "content": '<script>[{"say": "Hello!"}]</script>'}]


async def no_wait(seconds: float) -> None:
    await asyncio.sleep(0)


async def scenario(client: GatewayClient, chat: httpx.AsyncClient) -> list[Any]:
    """Register, one turn through the data plane, the trajectory, cancel, a refused turn,
    unregister: every answer, ids and times left out."""
    seen: list[Any] = [await client.register("r1", model="scripted", max_turns=4)]
    body = {"model": "scripted", "messages": TURN, "return_token_ids": True, "logprobs": True}
    answer = await chat.post("/v1/rollouts/r1/chat/completions", json=body)
    seen.append((answer.status_code, answer.json()["choices"][0]["message"]))
    trajectory = await client.get_trajectory("r1")
    for step in trajectory["trajectory"]:
        step.pop("trajectory_id")
        step["extras"].pop("timing")
    seen.append(trajectory)
    seen.append(await client.cancel("r1"))
    refused = await chat.post("/v1/rollouts/r1/chat/completions", json=body)
    seen.append((refused.status_code, refused.json()["error"]["code"]))
    seen.append(await client.unregister("r1"))
    return seen


async def test_one_scenario_gets_the_same_answers_from_the_fake_and_a_served_gateway() -> None:
    fake = FakeGateway()
    async with (
        GatewayClient("http://fake", transport=fake.transport(), retry=NO_RETRY) as client,
        httpx.AsyncClient(transport=fake.transport(), base_url="http://fake") as chat,
    ):
        through_fake = await scenario(client, chat)
    config = GatewayConfig(
        upstreams=[ENGINE_URL], open_control_plane=True, require_rollout_keys=False
    )
    engine = httpx.ASGITransport(create_scripted_model_app())
    async with (
        running_server(create_app(config, upstream_transport=engine)) as root,
        GatewayClient(root, retry=NO_RETRY) as client,
        httpx.AsyncClient(base_url=root) as chat,
    ):
        served = await scenario(client, chat)
    assert through_fake == served
    assert served[-2] == (403, "rollout_cancelled")


async def test_a_turn_an_agent_adds_is_recorded_as_the_data_plane_records_it() -> None:
    fake = FakeGateway()
    async with (
        GatewayClient("http://fake", transport=fake.transport(), retry=NO_RETRY) as client,
        httpx.AsyncClient(transport=fake.transport(), base_url="http://fake") as chat,
    ):
        await client.register("served", model="scripted")
        await client.register("added", model="scripted")
        body = {"model": "scripted", "messages": TURN, "return_token_ids": True, "logprobs": True}
        answer = (await chat.post("/v1/rollouts/served/chat/completions", json=body)).json()
        choice = answer["choices"][0]
        message = {k: v for k, v in choice["message"].items() if v is not None}
        ids = {
            "prompt_ids": answer["prompt_token_ids"],
            "completion_ids": choice["token_ids"],
            "completion_logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
        }
        fake.add_turn("added", TURN, [message], tokens=ids)
        served = (await client.get_trajectory("served"))["trajectory"][0]
        added = (await client.get_trajectory("added"))["trajectory"][0]
    assert (added["prompt"], added["tokens"]) == (served["prompt"], served["tokens"])
    assert added["completion"][0]["content"] == served["completion"][0]["content"]


async def test_injected_failures_and_latency_are_the_transports() -> None:
    fake = FakeGateway(latency=0.01)
    async with GatewayClient("http://fake", transport=fake.transport(), retry=NO_RETRY) as c:
        fake.fail("register", 503, httpx.ConnectError("refused"))
        with pytest.raises(GatewayUnavailableError):
            await c.register("r1", model="m")
        with pytest.raises(GatewayUnavailableError):
            await c.register("r1", model="m")
        assert fake.active == []  # neither reached the gateway
        await c.register("r1", model="m")
        assert fake.active == ["r1"] and fake.op_counts["register"] == 3
        await c.unregister("r1")
    assert fake.unregistered == ["r1"] and fake.active == []
    assert fake.calls[0] == ("POST", "/v1/rollouts/r1/register")


async def test_a_gateway_without_the_extensions() -> None:
    fake = FakeGateway(exit_reports=False, delta_trajectories=False)
    async with GatewayClient("http://fake", transport=fake.transport(), retry=NO_RETRY) as c:
        await c.register("r1", model="m")
        with pytest.raises(GatewayRequestError):
            await c.wait_exits(0, 0)
        answer = await c.get_trajectory("r1", expand=False)
        assert "format" not in answer  # the full form, as a gateway without the delta form


async def test_exit_streams_are_the_gateways_and_can_be_dropped() -> None:
    fake = FakeGateway()
    async with GatewayClient("http://fake", transport=fake.transport()) as client:
        await client.register("r1", model="m")
        await client.register("r2", model="m")
        watcher = ExitWatcher(client, sleep=no_wait)
        first = watcher.subscribe("r1")
        fake.exit_board.report("r1", 3)
        assert await asyncio.wait_for(first, 5) == 3
        assert len(fake.exit_streams) == 1 and fake.exit_stream_cursors == [0]
        fake.drop_exit_streams()  # the watcher reconnects from its cursor
        second = watcher.subscribe("r2")
        fake.exit_board.report("r2", 4)
        assert await asyncio.wait_for(second, 5) == 4
        assert fake.exit_stream_cursors == [0, 1]
        await watcher.aclose()
    assert fake.exit_streams == []
