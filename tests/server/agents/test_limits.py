"""Per-rollout budgets and memory (issue 11: availability findings), small limits."""

from __future__ import annotations

import asyncio
import threading
import time

import orjson
import pytest

from rollout_gateway.server.http.jsonio import BodyParser

from ..conftest import GatewayHarness, RecordingUpstream, script


def turn(text: str) -> list[dict]:
    return [{"role": "user", "content": script({"say": text})}]


async def refused(gw: GatewayHarness, rollout_id: str, messages: list[dict], code: str) -> None:
    r = await gw.chat(rollout_id, messages)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == code
    assert r.headers["x-should-retry"] == "false"


async def truncation(gw: GatewayHarness, rollout_id: str) -> tuple[bool, str | None]:
    traj = (await gw.trajectory(rollout_id)).json()
    return traj["is_truncated"], traj["truncation_reason"]


async def test_gateway_turn_budget_applies_when_register_sets_none(make_gateway) -> None:
    gw = await make_gateway(default_max_turns=2)
    await gw.register("r1", max_turns=-1)
    for i in range(2):
        assert (await gw.chat("r1", turn(f"t{i}"))).status_code == 200
    await refused(gw, "r1", turn("t2"), "max_turns_reached")
    assert await truncation(gw, "r1") == (True, "max_turns")


async def test_completion_token_budget_caps_and_then_refuses(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app(), max_total_completion_tokens=4)
    await gw.register("r1", sampling_params={"max_tokens": 100})
    r = await gw.chat("r1", turn("one two three four five six seven"))
    assert r.status_code == 200
    assert upstream.requests[-1]["max_tokens"] == 4  # the remaining budget caps the turn
    await refused(gw, "r1", turn("again"), "max_completion_tokens_reached")
    assert await truncation(gw, "r1") == (True, "max_completion_tokens")
    assert len(upstream.requests) == 1  # the refused turn never reached the engine


async def test_register_can_lower_the_completion_budget(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    await gw.register("r1", max_total_completion_tokens=3)
    await gw.chat("r1", turn("a b c d e"))
    assert upstream.requests[-1]["max_tokens"] == 3


async def test_context_limit_refuses_a_turn_extending_a_full_context(
    gw: GatewayHarness,
) -> None:
    await gw.register("r1", max_seq_len=20)  # the scripted prompt alone is longer
    first = turn("hello")
    answer = (await gw.chat("r1", first)).json()["choices"][0]["message"]
    history = [*first, answer, {"role": "user", "content": "more"}]
    await refused(gw, "r1", history, "max_context_reached")
    assert await truncation(gw, "r1") == (True, "max_context")


async def test_a_request_with_more_messages_than_the_bound_is_400(make_gateway) -> None:
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app(), max_messages=3)
    await gw.register("r1")
    filler = [{"role": "user", "content": "context"}] * 2
    assert (await gw.chat("r1", [*filler, *turn("ok")])).status_code == 200  # 3: taken
    r = await gw.chat("r1", [*filler, *filler, *turn("ok")])  # 5: refused
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "too_many_messages"
    assert "at most 3" in r.json()["error"]["message"]
    assert len(upstream.requests) == 1  # never reached the engine
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 1 and traj["status"] == "active"  # the rollout goes on


async def test_stored_message_bytes_are_bounded(make_gateway) -> None:
    gw = await make_gateway(max_rollout_message_bytes=3000)
    await gw.register("r1")
    # An agent that rewrites its whole (big) history every turn pays for every copy.
    for i in range(2):
        big = [{"role": "user", "content": script({"say": "ok"}) + f" {i} " + "x" * 1000}]
        assert (await gw.chat("r1", big)).status_code == 200
    big = [{"role": "user", "content": script({"say": "ok"}) + " 2 " + "x" * 1000}]
    await refused(gw, "r1", big, "max_rollout_bytes_reached")
    assert await truncation(gw, "r1") == (True, "max_rollout_bytes")


async def test_stop_strings_count_against_the_stored_bytes(make_gateway) -> None:
    gw = await make_gateway(max_rollout_message_bytes=3000)
    await gw.register("r1")
    # Recorded in each step's extras.sampling: an agent must not store them for free.
    stop = [f"stop-{i:04d}" for i in range(120)]  # ~1.6 kB of JSON
    body = {"messages": turn("ok"), "stop": stop}
    assert (await gw.chat("r1", body)).status_code == 200
    body["messages"] = [*turn("ok"), {"role": "assistant", "content": "ok"}, *turn("again")]
    r = await gw.chat("r1", body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "max_rollout_bytes_reached"


async def test_the_dropped_field_names_a_turn_keeps_are_bounded(gw: GatewayHarness) -> None:
    await gw.register("r1")
    body: dict = {"messages": turn("hi"), "temperature": 0.5, "a" * 100_000: 1}
    body.update({f"x{i:05d}": i for i in range(5000)})
    assert (await gw.chat("r1", body)).status_code == 200
    extras = (await gw.trajectory("r1")).json()["trajectory"][0]["extras"]
    names = ["a" * 64, "temperature", *(f"x{i:05d}" for i in range(30))]
    assert extras["dropped_fields"] == names
    assert extras["dropped_fields_omitted"] == 5002 - 32


async def test_message_fields_the_trajectory_does_not_need_are_not_kept(
    gw: GatewayHarness,
) -> None:
    await gw.register("r1")
    message = {
        "role": "user",
        "content": script({"say": "hi"}),
        "cache_control": {"type": "ephemeral"},
        "vendor_blob": "z" * 10_000,
    }
    assert (await gw.chat("r1", [message])).status_code == 200
    prompt = (await gw.trajectory("r1")).json()["trajectory"][0]["prompt"]
    assert prompt == [{"role": "user", "content": message["content"]}]
    record = gw.gateway.registry.get("r1")
    assert record.message_bytes < 1000


async def test_too_many_concurrent_requests_of_one_rollout_are_429(make_gateway) -> None:
    import asyncio

    gw = await make_gateway(RecordingUpstream(latency_s=0.2).app(), max_pending_turns=2)
    await gw.register("r1")
    tasks = [asyncio.create_task(gw.chat("r1", turn(f"p{i}"))) for i in range(2)]
    await asyncio.sleep(0.05)
    r = await gw.chat("r1", turn("p3"))
    assert r.status_code == 429
    assert [t.status_code for t in await asyncio.gather(*tasks)] == [200, 200]


def _tracking_loads(gate: threading.Event | None = None, big: int = 0):
    """An orjson.loads that records how many parses of bodies over ``big`` bytes run at
    once (in worker threads)."""
    lock = threading.Lock()
    state = {"now": 0, "max": 0, "calls": 0}

    def loads(raw: bytes):
        if len(raw) <= big:
            return orjson.loads(raw)
        with lock:
            state["now"] += 1
            state["calls"] += 1
            state["max"] = max(state["max"], state["now"])
        try:
            if gate is not None:
                gate.wait(5)
            else:
                time.sleep(0.02)
            return orjson.loads(raw)
        finally:
            with lock:
                state["now"] -= 1

    return loads, state


async def test_big_bodies_parse_at_most_n_at_once_and_small_ones_never_wait() -> None:
    gate = threading.Event()
    loads, state = _tracking_loads(gate, big=100)
    parser = BodyParser(2, off_loop_bytes=100, loads=loads)
    big = orjson.dumps({"pad": "x" * 200})
    parses = [asyncio.ensure_future(parser.loads(big)) for _ in range(6)]
    await asyncio.sleep(0.1)
    assert state["max"] == 2 and state["calls"] == 2  # the other four wait their turn
    # A small body is parsed at once, on the loop, while the big ones hold every slot.
    assert await asyncio.wait_for(parser.loads(b'{"a": 1}'), 1) == {"a": 1}
    gate.set()
    assert [r["pad"] for r in await asyncio.gather(*parses)] == ["x" * 200] * 6
    assert state["max"] == 2
    with pytest.raises(ValueError, match="max_concurrent"):
        BodyParser(0)


async def test_the_chat_route_parses_big_bodies_under_the_gateway_bound(make_gateway) -> None:
    gw = await make_gateway(max_concurrent_parses=1)
    gateway = gw.app.state.gateway
    assert gateway.body_parser.max_concurrent == 1
    loads, state = _tracking_loads()
    gateway.body_parser = BodyParser(1, loads=loads)  # the same bound, observed
    padding = "y" * (300 * 1024)  # over the 256 KiB off-loop threshold
    for i in range(3):
        await gw.register(f"big{i}")
    answers = await asyncio.gather(
        *(
            gw.chat(f"big{i}", [{"role": "user", "content": script({"say": "ok"}) + padding}])
            for i in range(3)
        )
    )
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert state["calls"] == 3 and state["max"] == 1


async def exits(gw: GatewayHarness) -> list[dict]:
    return (await gw.client.get("/v1/rollouts/exits", params={"after": 0})).json()["exits"]


async def test_a_refused_turn_is_reported_on_the_exit_channel_once(make_gateway) -> None:
    # Whatever the agent does with the 403 (some frameworks retry it for minutes), the env
    # hears of it on the exit channel and stops the agent.
    gw = await make_gateway(default_max_turns=1)
    await gw.register("r1")
    assert (await gw.chat("r1", turn("t0"))).status_code == 200
    assert await exits(gw) == []
    for _ in range(3):  # the agent retries the refused turn
        await refused(gw, "r1", turn("t1"), "max_turns_reached")
    (report,) = await exits(gw)
    assert (report["rollout_id"], report["refused"]) == ("r1", "max_turns_reached")
    first_seq = report["seq"]
    assert (await exits(gw))[0]["seq"] == first_seq  # the retries reported nothing more


async def test_the_agent_cannot_erase_or_forge_a_refusal(make_gateway) -> None:
    gw = await make_gateway(default_max_turns=1)
    await gw.register("r1")
    await gw.register("r2")
    await gw.chat("r1", turn("t0"))
    await refused(gw, "r1", turn("t1"), "max_turns_reached")
    headers = gw.agent_headers("r1")
    # Its own exit report (or a forged one) keeps the gateway's refusal on the report.
    r = await gw.client.post("/v1/rollouts/r1/exit", json={"exit_code": 0}, headers=headers)
    assert r.status_code == 200
    r = await gw.client.post(
        "/v1/rollouts/r2/exit",
        json={"exit_code": None, "refused": "max_turns_reached"},
        headers=gw.agent_headers("r2"),
    )
    assert r.status_code == 200
    reports = {e["rollout_id"]: e for e in await exits(gw)}
    assert reports["r1"]["refused"] == "max_turns_reached" and reports["r1"]["exit_code"] == 0
    assert "refused" not in reports["r2"]  # an agent's word is not a refusal


async def test_the_wrappers_start_report_never_replaces_an_exit(make_gateway) -> None:
    gw = await make_gateway()
    await gw.register("r1")
    await gw.register("r2")
    started = {"exit_code": None, "started": True}
    await gw.client.post("/v1/rollouts/r1/exit", json=started, headers=gw.agent_headers("r1"))
    exit_report = {"exit_code": 3}
    await gw.client.post("/v1/rollouts/r2/exit", json=exit_report, headers=gw.agent_headers("r2"))
    # Sent beside the agent, a start report may arrive after the exit: it is dropped then.
    await gw.client.post("/v1/rollouts/r2/exit", json=started, headers=gw.agent_headers("r2"))
    reports = {e["rollout_id"]: e for e in await exits(gw)}
    assert reports["r1"]["started"] is True and reports["r1"]["exit_code"] is None
    assert reports["r2"]["exit_code"] == 3 and "started" not in reports["r2"]
    bad = await gw.client.post(
        "/v1/rollouts/r1/exit", json={"started": "yes"}, headers=gw.agent_headers("r1")
    )
    assert bad.status_code == 400
