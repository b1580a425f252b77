"""Per-rollout budgets and memory (issue 11: availability findings), small limits."""

from __future__ import annotations

import asyncio
import threading
import time

import orjson
import pytest

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server.http.intake import BodyIntake, IntakeLimits

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


def _limits(**fields) -> IntakeLimits:
    values = {
        "max_body_bytes": 1 << 20,
        "max_body_cost": 64 << 20,
        "body_memory": 1 << 30,
        "max_concurrent_parses": 2,
        "rollout_parse_share": 1.0,
    }
    values.update(fields)
    return IntakeLimits(**values)


async def test_big_bodies_parse_at_most_n_at_once_and_small_ones_never_wait() -> None:
    gate = threading.Event()
    loads, state = _tracking_loads(gate, big=100)
    intake = BodyIntake(_limits(big_body_bytes=100), loads=loads)
    big = orjson.dumps({"pad": "x" * 200})
    parses = [
        asyncio.ensure_future(intake.parse(intake.lease(f"rollout-{i}"), big)) for i in range(6)
    ]
    await asyncio.sleep(0.1)
    assert state["max"] == 2 and state["calls"] == 2  # the other four wait their turn
    # A small body is parsed at once, on the loop, while the big ones hold every slot.
    small = intake.parse(intake.lease("small"), b'{"a": 1}')
    assert await asyncio.wait_for(small, 1) == {"a": 1}
    gate.set()
    assert [r["pad"] for r in await asyncio.gather(*parses)] == ["x" * 200] * 6
    assert state["max"] == 2
    with pytest.raises(ValueError, match="max-concurrent-parses|max_concurrent"):
        BodyIntake(_limits(max_concurrent_parses=0, body_memory=1 << 30))


async def test_the_chat_route_parses_big_bodies_under_the_gateway_bound(make_gateway) -> None:
    gw = await make_gateway(max_concurrent_parses=1)
    gateway = gw.app.state.gateway
    assert gateway.intake.limits.max_concurrent_parses == 1
    loads, state = _tracking_loads()
    gateway.intake = BodyIntake(gateway.config.intake, loads=loads)  # observed
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


# -- one agent cannot take the gateway down (issue 26) -----------------------------------


async def test_fields_the_gateway_never_reads_are_not_kept_while_the_turn_waits(
    make_gateway,
) -> None:
    import weakref

    class Pad(list):
        """A parsed ``pad`` whose lifetime the test can see."""

    seen: list[weakref.ref] = []

    def loads(raw: bytes):
        body = orjson.loads(raw)
        if isinstance(body, dict) and "pad" in body:
            body["pad"] = Pad(body["pad"])
            seen.append(weakref.ref(body["pad"]))
        return body

    upstream = RecordingUpstream(latency_s=0.5)
    gw = await make_gateway(upstream.app())
    gateway = gw.app.state.gateway
    gateway.intake = BodyIntake(gateway.config.intake, loads=loads)
    await gw.register("r1")
    body = {"messages": turn("hi"), "pad": [{}] * 1000}
    waiting = asyncio.ensure_future(gw.chat("r1", body))
    while not upstream.events:  # the turn waits on the engine
        await asyncio.sleep(0.01)
    assert seen and seen[0]() is None  # the pad is gone already
    assert (await waiting).status_code == 200
    extras = (await gw.trajectory("r1")).json()["trajectory"][0]["extras"]
    assert extras["dropped_fields"] == ["pad"]  # still named among the dropped fields


async def test_another_rollouts_turn_is_served_while_a_big_parse_is_held(
    make_gateway,
) -> None:
    gate = threading.Event()
    big_parses: list[int] = []

    def loads(raw: bytes):
        if len(raw) > 256 * 1024:
            big_parses.append(len(raw))
            gate.wait(10)
        return orjson.loads(raw)

    # An engine without a context bound: the 1 MiB prompt is about the parse, not the context.
    gw = await make_gateway(create_scripted_model_app(max_model_len=None))
    gateway = gw.app.state.gateway
    gateway.intake = BodyIntake(gateway.config.intake, loads=loads)
    await gw.register("attacker")
    await gw.register("victim")
    big = [{"role": "user", "content": script({"say": "ok"}) + " " + "x" * (1024 * 1024)}]
    attack = asyncio.ensure_future(gw.chat("attacker", big))
    while not big_parses:
        await asyncio.sleep(0.01)
    r = await asyncio.wait_for(gw.chat("victim", turn("meanwhile")), 10)
    assert r.status_code == 200 and not attack.done()
    gate.set()
    assert (await attack).status_code == 200


async def test_a_finished_rollout_refuses_a_big_body_without_parsing_it(make_gateway) -> None:
    parsed: list[int] = []

    def loads(raw: bytes):
        parsed.append(len(raw))
        return orjson.loads(raw)

    gw = await make_gateway()
    gateway = gw.app.state.gateway
    gateway.intake = BodyIntake(gateway.config.intake, loads=loads)
    await gw.register("r1", max_turns=1)
    first = turn("the only turn")
    assert (await gw.chat("r1", first)).status_code == 200
    parsed.clear()
    big = [{"role": "user", "content": script({"say": "more"}) + " " + "x" * (1024 * 1024)}]
    await refused(gw, "r1", big, "max_turns_reached")
    assert parsed == []  # read and hashed, never parsed
    # A retry of the last turn still gets its answer (it is matched before any refusal).
    retry = await gw.chat("r1", first, headers={"x-stainless-retry-count": "1"})
    assert retry.status_code == 200


async def test_a_rollouts_big_bodies_wait_for_its_share_of_time(make_gateway) -> None:
    gw = await make_gateway(rollout_parse_share=0.5)
    gateway = gw.app.state.gateway
    slept: list[float] = []
    cpu = {"now": 0.0}

    def loads(raw: bytes):
        cpu["now"] += 0.3  # a parse of 0.3 s of CPU
        return orjson.loads(raw)

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    gateway.intake = BodyIntake(
        gateway.config.intake,
        loads=loads,
        cpu_clock=lambda: cpu["now"],
        clock=lambda: 100.0,  # time stands still: only the share's wait counts
        sleep=sleep,
    )
    await gw.register("r1")
    await gw.register("r2")
    for i in range(2):
        big = [{"role": "user", "content": script({"say": f"{i}"}) + " " + "x" * 300_000}]
        assert (await gw.chat("r1", big)).status_code == 200
    assert slept == [pytest.approx(0.3)]  # a share of 0.5: as long as it took
    big = [{"role": "user", "content": script({"say": "r2"}) + " " + "x" * 300_000}]
    assert (await gw.chat("r2", big)).status_code == 200
    assert len(slept) == 1  # another rollout does not wait for it


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


async def test_an_exit_report_is_small_and_within_the_rollouts_budgets(gw: GatewayHarness) -> None:
    await gw.register("r1")
    headers = gw.agent_headers("r1")
    big = await gw.client.post(
        "/v1/rollouts/r1/exit", json={"exit_code": 0, "pad": [{}] * 2000}, headers=headers
    )
    assert big.status_code == 413, big.text
    ok = await gw.client.post("/v1/rollouts/r1/exit", json={"exit_code": 0}, headers=headers)
    assert ok.status_code == 200, ok.text
    intake = gw.gateway.intake
    assert intake.raw.held == 0 and intake.parsed.held == 0  # released once answered


async def test_a_retry_of_the_last_turn_after_a_restart_is_answered_not_refused(
    tmp_path,
) -> None:
    """A rollout finished by its last turn (max_turns) refuses new turns before parsing
    them, but a retry of that turn after a restart gets its stored answer (issue 26's
    early refusal never shadows the store's answer)."""
    import contextlib

    import httpx

    from rollout_gateway.server import GatewayConfig, create_app
    from rollout_gateway.server.state.sqlite import SQLiteStore

    from ..conftest import ADMIN_TOKEN, UPSTREAM

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    upstream = RecordingUpstream().app()

    @contextlib.asynccontextmanager
    async def running():
        config = GatewayConfig(upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN)
        app = create_app(
            config,
            upstream_transport=httpx.ASGITransport(upstream),
            store=SQLiteStore(tmp_path / "state"),
        )
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://gw"
            ) as client:
                yield client

    body = {"messages": turn("the only turn"), "return_token_ids": True, "logprobs": True}
    async with running() as gw:
        r = await gw.post("/v1/rollouts/r1/register", json={"model": "m", "max_turns": 1},
                          headers=admin)  # fmt: skip
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        first = await gw.post("/v1/rollouts/r1/chat/completions", json=body, headers=key)
        assert first.status_code == 200
    async with running() as gw:
        for attempt in (1, 2):  # the second finds the record loaded (and finished)
            retry = await gw.post(
                "/v1/rollouts/r1/chat/completions",
                json=body,
                headers={**key, "x-stainless-retry-count": str(attempt)},
            )
            assert retry.status_code == 200, retry.text
            assert retry.json() == first.json()
        new = {"messages": turn("one more"), "return_token_ids": True}
        refused_turn = await gw.post("/v1/rollouts/r1/chat/completions", json=new, headers=key)
        assert refused_turn.status_code == 403
        assert refused_turn.json()["error"]["code"] == "max_turns_reached"
