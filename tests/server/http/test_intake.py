"""Request bodies are admitted before they are read and costed before they are parsed
(issue 26: one agent cannot take the gateway down)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import orjson
import pytest

from rollout_gateway.server.http.budget import ByteBudget
from rollout_gateway.server.http.connections import ReadTimer
from rollout_gateway.server.http.intake import (
    VALUE_COST,
    BodyIntake,
    IntakeLimits,
    body_cost,
    worst_case_cost,
)
from rollout_gateway.server.http.responses import ApiError

MiB = 1024 * 1024


def limits(**fields: Any) -> IntakeLimits:
    values: dict[str, Any] = {
        "max_body_bytes": 1 * MiB,
        "max_body_cost": 8 * MiB,
        "body_memory": 64 * MiB,
        "max_concurrent_parses": 2,
        "rollout_parse_share": 1.0,
        "big_body_bytes": 100,
    }
    values.update(fields)
    return IntakeLimits(**values)


def receiver(body: bytes, pieces: int = 1) -> Any:
    """An ASGI ``receive`` handing ``body`` over in ``pieces``; records that it was called."""
    size = -(-len(body) // pieces) if body else 0
    chunks = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    state = {"calls": 0}

    async def receive() -> dict[str, Any]:
        state["calls"] += 1
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    receive.state = state  # type: ignore[attr-defined]
    return receive


# -- the estimate --------------------------------------------------------------------------------


def test_the_parse_cost_counts_values_not_only_bytes() -> None:
    text = b'{"messages": [{"role": "user", "content": "plain words"}]}'
    assert body_cost(text) == len(text) + VALUE_COST * 4  # two "{", one "[", one ","
    pad = b"[" + b"{}," * 1000 + b"{}]"
    assert body_cost(pad) == len(pad) + VALUE_COST * (1 + 1001 + 1000)
    # It stops counting once past the bound it is checked against.
    assert body_cost(pad * 2000, stop_above=10 * MiB) < body_cost(pad * 2000)
    assert worst_case_cost(100) == 100 * (1 + VALUE_COST)


def test_the_estimate_is_above_what_orjson_builds() -> None:
    """The estimate bounds the real cost of the shapes that cost the most per byte."""
    import tracemalloc

    shapes = [b"{},", b"[],", b'"a",', b"1.5,", b"0,", b'{"k":[]},']
    for piece in shapes:
        raw = b"[" + piece * 20000 + b"0]"
        tracemalloc.start()
        value = orjson.loads(raw)
        built = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del value
        assert built <= body_cost(raw), piece


def test_bounds_that_cannot_hold_together_are_refused_naming_the_options() -> None:
    assert limits().problems() == []
    problems = " ".join(limits(max_body_cost=MiB // 2).problems())
    assert "--max-body-cost" in problems and "--max-body-bytes" in problems
    problems = " ".join(limits(body_memory=16 * MiB).problems())
    assert "--body-memory" in problems and "--max-concurrent-parses" in problems
    assert "--rollout-parse-share" in " ".join(limits(rollout_parse_share=1.5).problems())
    with pytest.raises(ValueError, match="--body-memory"):
        BodyIntake(limits(body_memory=16 * MiB))


# -- admission and cost --------------------------------------------------------------------------


async def test_a_body_over_its_cost_is_refused_before_it_is_parsed() -> None:
    parsed: list[bytes] = []

    def loads(raw: bytes) -> Any:
        parsed.append(raw)
        return orjson.loads(raw)

    intake = BodyIntake(limits(max_body_cost=2 * MiB), loads=loads)
    pad = b'{"messages": [], "pad": [' + b"{}," * 100_000 + b"{}]}"  # 300 KB, ~19 MB parsed
    lease = intake.lease("r1")
    raw = await intake.read(lease, receiver(pad, 4), str(len(pad)))
    with pytest.raises(ApiError) as refused:
        await intake.parse(lease, raw)
    assert refused.value.status_code == 413 and refused.value.code == "request_too_complex"
    assert parsed == [] and intake.refused_complex == 1
    lease.release()
    assert intake.raw.held == 0 and intake.parsed.held == 0


async def test_a_declared_body_over_the_limit_is_refused_before_a_byte_is_read() -> None:
    intake = BodyIntake(limits())
    receive = receiver(b"x")
    with pytest.raises(ApiError) as refused:
        await intake.read(intake.lease("r1"), receive, str(2 * MiB))
    assert refused.value.status_code == 413 and receive.state["calls"] == 0


async def test_bodies_wait_for_room_before_they_are_read() -> None:
    # Room for one 1 MiB body at a time beside the two parses.
    intake = BodyIntake(limits(body_memory=2 * 8 * MiB + MiB))
    body = b'{"a": "' + b"x" * (MiB - 10) + b'"}'
    first, second = intake.lease("r1"), intake.lease("r2")
    raw = await intake.read(first, receiver(body), str(len(body)))
    receive = receiver(body)
    waiting = asyncio.ensure_future(intake.read(second, receive, str(len(body))))
    await asyncio.sleep(0.05)
    assert not waiting.done() and receive.state["calls"] == 0  # not a byte read
    await intake.parse(first, raw)
    first.drop_raw()  # parsed: its bytes are gone
    assert await asyncio.wait_for(waiting, 1) == body
    first.release()
    second.release()


async def test_one_rollout_keeps_at_most_one_maximum_body_alive() -> None:
    intake = BodyIntake(limits(max_body_cost=4 * MiB))
    body = b'{"a": "' + b"x" * (3 * MiB // 2) + b'"}'  # costs about 1.5 MiB; 2 fit, 3 do not
    leases = [intake.lease("agent") for _ in range(3)]
    for lease in leases[:2]:
        assert await intake.parse(lease, body) == {"a": "x" * (3 * MiB // 2)}
    third = asyncio.ensure_future(intake.parse(leases[2], body))
    other = intake.lease("other rollout")
    assert await asyncio.wait_for(intake.parse(other, body), 1)  # never held up
    await asyncio.sleep(0.05)
    assert not third.done()
    leases[0].release()  # answered: its body is gone
    assert await asyncio.wait_for(third, 1)
    for lease in (*leases, other):
        lease.release()
    assert intake.parsed.held == 0


async def test_one_rollout_cannot_hold_every_parse_slot() -> None:
    """A rollout's second big body waits on its own budget, not in the parse queue: a
    big body of another rollout is parsed meanwhile."""
    gate = threading.Event()
    running: list[int] = []

    def loads(raw: bytes) -> Any:
        running.append(len(raw))
        gate.wait(5)
        return orjson.loads(raw)

    intake = BodyIntake(limits(max_body_cost=MiB, max_concurrent_parses=2), loads=loads)
    body = b'{"a": "' + b"x" * (MiB // 2 + 100) + b'"}'  # one fits a rollout's budget
    attacker = [
        asyncio.ensure_future(intake.parse(intake.lease("attacker"), body)) for _ in range(2)
    ]
    await asyncio.sleep(0.1)
    assert len(running) == 1  # its second body waits on its own budget, holding no slot
    victim = asyncio.ensure_future(intake.parse(intake.lease("victim"), body))
    await asyncio.sleep(0.1)
    assert len(running) == 2  # the victim's is parsed beside the attacker's
    gate.set()
    await asyncio.wait_for(victim, 2)
    await asyncio.wait_for(attacker[0], 2)
    attacker[1].cancel()


# -- fair share of time --------------------------------------------------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0
        self.slept: list[tuple[str, float]] = []
        self.current = ""

    def clock(self) -> float:
        return self.now

    def cpu_clock(self) -> float:
        return self.cpu

    async def sleep(self, seconds: float) -> None:
        self.slept.append((self.current, seconds))
        self.now += seconds


async def test_a_rollouts_big_bodies_take_at_most_their_share_of_time() -> None:
    fake = FakeTime()

    def loads(raw: bytes) -> Any:
        fake.cpu += 0.2  # each parse takes 0.2 s of CPU
        return orjson.loads(raw)

    intake = BodyIntake(
        limits(rollout_parse_share=0.1),
        loads=loads,
        cpu_clock=fake.cpu_clock,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    body = b'{"a": "' + b"x" * 1000 + b'"}'

    async def turn(key: str, read_s: float = 0.0) -> None:
        fake.current = key
        lease = intake.lease(key)
        timer = ReadTimer()
        timer.seconds = read_s
        raw = await intake.read(lease, receiver(body), str(len(body)), timer)
        await intake.parse(lease, raw)
        lease.release()

    await turn("attacker", read_s=0.05)
    assert fake.slept == []  # the first one at once
    await turn("attacker")
    # It took 0.05 s to read and 0.2 s to parse: at a share of 0.1, the next waits 9x.
    assert fake.slept == [("attacker", pytest.approx(0.25 * 9))]
    await turn("victim")
    assert len(fake.slept) == 1  # another rollout never waits for it
    fake.now += 100
    await turn("attacker")
    assert len(fake.slept) == 1  # once that time has passed, its next one is not held


async def test_a_small_body_never_waits_for_its_share() -> None:
    fake = FakeTime()
    intake = BodyIntake(
        limits(rollout_parse_share=0.01, big_body_bytes=10_000),
        cpu_clock=fake.cpu_clock,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    for _ in range(3):
        lease = intake.lease("r1")
        raw = await intake.read(lease, receiver(b'{"a": 1}'), "8")
        await intake.parse(lease, raw)
        lease.release()
    assert fake.slept == []


# -- the budget ----------------------------------------------------------------------------------


async def test_the_budget_serves_in_order_and_passes_over_a_full_key() -> None:
    budget = ByteBudget(capacity=100, per_key=60)
    await budget.acquire("a", 60)
    a_again = asyncio.ensure_future(budget.acquire("a", 10))  # its key is full
    b = asyncio.ensure_future(budget.acquire("b", 30))
    await asyncio.sleep(0)
    assert b.done() and not a_again.done()  # passed over, not in the way
    big = asyncio.ensure_future(budget.acquire("c", 50))  # waits for the shared room
    small = asyncio.ensure_future(budget.acquire("d", 5))
    await asyncio.sleep(0)
    assert not big.done() and not small.done()  # first come, first served
    budget.release("a", 60)
    await asyncio.sleep(0)
    assert a_again.done() and big.done() and small.done()
    with pytest.raises(ValueError):
        await budget.acquire("e", 61)


async def test_a_cancelled_wait_holds_nothing() -> None:
    budget = ByteBudget(capacity=10, per_key=10)
    await budget.acquire("a", 10)
    waiting = asyncio.ensure_future(budget.acquire("b", 5))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    budget.release("a", 10)
    assert budget.held == 0 and budget.waiting == 0


@pytest.mark.parametrize("size", [50, 5000])  # parsed on the loop; in a worker thread
async def test_a_chat_bodys_messages_text_is_left_on_its_lease(size: int) -> None:
    intake = BodyIntake(limits(big_body_bytes=1000))
    messages = [{"role": "user", "content": "x" * size}]
    body = orjson.dumps({"model": "m", "messages": messages})
    lease = intake.lease("r")
    parsed = await intake.parse(lease, body)
    assert parsed == {"model": "m", "messages": messages}
    assert lease.messages_text == orjson.dumps(messages)
    other = intake.lease("r")
    assert await intake.parse(other, b'{"model": "m"}') == {"model": "m"}
    assert other.messages_text is None
    lease.release()
    other.release()
