"""Retries never become turns; an answer nobody received is recorded as abandoned."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rollout_gateway.server.agents.chat import MAX_TURN_WAITERS

from ..conftest import GatewayHarness, RecordingUpstream, script


def turn(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": script({"say": text})}]


RETRY = {"x-stainless-retry-count": "1"}


async def test_retry_while_the_turn_runs_joins_it(make_gateway) -> None:
    upstream = RecordingUpstream(latency_s=0.2)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    first = asyncio.create_task(gw.chat("r1", turn("once")))
    await asyncio.sleep(0.05)
    retry = await gw.chat("r1", turn("once"), headers=RETRY)
    original = await first
    assert retry.status_code == original.status_code == 200
    assert retry.json()["id"] == original.json()["id"]
    assert len(upstream.requests) == 1
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 1 and len(traj["trajectory"]) == 1


async def test_a_turn_takes_a_bounded_number_of_waiting_retries(make_gateway) -> None:
    """Each waiting request holds a connection: one agent repeating a slow turn must not
    hold all of them."""
    upstream = RecordingUpstream(latency_s=0.5)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    waiting = [asyncio.create_task(gw.chat("r1", turn("slow")))]
    await asyncio.sleep(0.05)
    waiting += [
        asyncio.create_task(gw.chat("r1", turn("slow"), headers=RETRY))
        for _ in range(MAX_TURN_WAITERS - 1)
    ]
    await asyncio.sleep(0.1)
    refused = await gw.chat("r1", turn("slow"), headers=RETRY)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "too_many_waiters"
    assert refused.headers["x-should-retry"] == "false"  # the SDK does not retry it
    answers = await asyncio.gather(*waiting)
    assert {a.status_code for a in answers} == {200}
    assert len({a.json()["id"] for a in answers}) == 1  # one turn, answered to each
    assert len(upstream.requests) == 1


async def test_retry_after_the_answer_replays_it(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    original = await gw.chat("r1", turn("once"))
    retry = await gw.chat("r1", turn("once"), headers=RETRY)
    assert retry.json()["id"] == original.json()["id"]
    assert len(upstream.requests) == 1
    assert (await gw.trajectory("r1")).json()["num_turns"] == 1
    metrics = (await gw.client.get("/metrics")).text
    assert "rollout_gateway_deduplicated_requests_total 1" in metrics


async def test_idempotency_key_identifies_the_turn(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    key = {"Idempotency-Key": "k-1"}
    original = await gw.chat("r1", turn("once"), headers=key)
    again = await gw.chat("r1", turn("once"), headers=key)
    other = await gw.chat("r1", turn("once"), headers={"Idempotency-Key": "k-2"})
    assert again.json()["id"] == original.json()["id"] != other.json()["id"]
    assert len(upstream.requests) == 2


async def test_a_blank_idempotency_key_identifies_nothing(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    for blank in ("", " "):  # sent on every call by a misconfigured client
        first = await gw.chat("r1", turn(f"one{blank}"), headers={"Idempotency-Key": blank})
        second = await gw.chat("r1", turn(f"two{blank}"), headers={"Idempotency-Key": blank})
        assert first.json()["id"] != second.json()["id"]
    assert len(upstream.requests) == 4
    assert (await gw.trajectory("r1")).json()["num_turns"] == 4


async def test_same_body_without_retry_marks_after_the_answer_is_a_new_turn(
    make_gateway,
) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    await gw.chat("r1", turn("again"))
    await gw.chat("r1", turn("again"))
    assert len(upstream.requests) == 2


async def test_retry_window_expires(make_gateway) -> None:
    from ..conftest import FakeClock

    clock = FakeClock()
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app(), clock=clock, retry_dedupe_window_s=10)
    await gw.register("r1")
    await gw.chat("r1", turn("once"))
    clock.advance(11)
    await gw.chat("r1", turn("once"), headers=RETRY)
    assert len(upstream.requests) == 2


async def _disconnecting_call(gw: GatewayHarness, rollout_id: str, body: dict) -> int | None:
    """Send a chat request straight to the ASGI app and hang up before the answer."""
    raw = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        (b"authorization", f"Bearer {gw.keys[rollout_id]}".encode()),
    ]
    path = f"/v1/rollouts/{rollout_id}/chat/completions"
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
        "server": ("gateway", 80), "state": {},
    }  # fmt: skip
    sent = False
    statuses: list[int] = []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(0.05)  # the agent's SDK times out and closes the socket
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await gw.app(scope, receive, send)
    return statuses[0] if statuses else None


async def test_abandoned_turn_is_not_a_turn_the_agent_saw(make_gateway) -> None:
    upstream = RecordingUpstream(latency_s=0.2)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    await _disconnecting_call(gw, "r1", {"messages": turn("lost")})
    await asyncio.sleep(0.3)  # the turn finishes without anyone to answer
    assert (await gw.chat("r1", turn("next"))).status_code == 200  # the agent moved on
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 1 and traj["abandoned_turns"] == 1
    assert [s["prompt"] for s in traj["trajectory"]] == [turn("next")]
    assert "history_rewritten" not in traj["trajectory"][0]["extras"]


async def test_retry_after_a_disconnect_gets_the_finished_turn(make_gateway) -> None:
    upstream = RecordingUpstream(latency_s=0.2)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    await _disconnecting_call(gw, "r1", {"messages": turn("lost")})
    raw = json.dumps({"messages": turn("lost")}).encode()  # the SDK resends the same bytes
    retry = await gw.client.post(
        "/v1/rollouts/r1/chat/completions",
        content=raw,
        headers=gw.agent_headers("r1", {**RETRY, "Content-Type": "application/json"}),
    )
    assert retry.status_code == 200
    assert len(upstream.requests) == 1
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 1 and traj["abandoned_turns"] == 0
