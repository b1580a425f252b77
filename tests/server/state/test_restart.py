"""A gateway restarted on its state goes on with every rollout (in-process restarts).

Each test runs a gateway, stops it, and starts another on the same store: the SQLite
backend on the same directory, and (to check the same restore path without a disk) the
memory backend's same store object. The crash itself (``kill -9`` of a real process) is
``test_crash.py``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.shared_memory import SharedMemoryStore, coordination

from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.state.dedupe import Turn
from rollout_gateway.server.state.memory import MemoryStore
from rollout_gateway.server.state.registry import RolloutRecord, RolloutRegistry
from rollout_gateway.server.state.sqlite import SQLiteStore
from rollout_gateway.server.state.store import RolloutStore
from rollout_gateway.server.state.stored import StoredRollouts

from ..conftest import ADMIN_TOKEN, UPSTREAM, RecordingUpstream, script

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
RETRY = {"x-stainless-retry-count": "1"}
STEPS = [{"tool": "run", "arguments": {"cmd": f"step {i}"}} for i in range(5)] + [{"say": "done"}]


@pytest.fixture(params=["sqlite", "memory"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], RolloutStore]:
    if request.param == "sqlite":
        return lambda: SQLiteStore(tmp_path / "state")
    memory = MemoryStore()
    return lambda: memory


@contextlib.asynccontextmanager
async def running(
    upstream: Any, store: RolloutStore, **fields: Any
) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewayConfig.from_fields(upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN, **fields)
    app = create_app(
        config,
        upstream_transport=httpx.ASGITransport(upstream),
        store=store,
        coordinator=coordination(store),
    )
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://gw"
        ) as client:
            yield client


class Agent:
    """A scripted agent: it sends its conversation, appends each answer and tool output."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": script(*STEPS)}]
        self.answers: list[dict[str, Any]] = []

    def body(self) -> dict[str, Any]:
        return {"model": "m", "messages": self.messages, "return_token_ids": True, "logprobs": True}

    async def turn(self, client: httpx.AsyncClient, headers: Any = None) -> httpx.Response:
        r = await client.post(
            "/v1/rollouts/r1/chat/completions",
            json=self.body(),
            headers={"Authorization": f"Bearer {self.key}", **(headers or {})},
        )
        return r

    def take(self, answer: dict[str, Any]) -> None:
        self.answers.append(answer)
        message = answer["choices"][0]["message"]
        self.messages.append({k: v for k, v in message.items() if v is not None})
        for call in message.get("tool_calls") or ():
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})


def tokens_of(trajectory: dict[str, Any]) -> list[Any]:
    return [
        (s["prompt"], s["completion"], s["tokens"], s["is_truncated"])
        for s in trajectory["trajectory"]
    ]


async def test_a_restarted_gateway_goes_on_with_the_rollout(make_store: Any) -> None:
    upstream = RecordingUpstream()
    app = upstream.app()
    async with running(app, make_store()) as gw:
        r = await gw.post(
            "/v1/rollouts/r1/register",
            json={"model": "m", "max_turns": 5, "max_total_tokens": 10**6},
            headers=ADMIN,
        )
        agent = Agent(r.json()["api_key"])
        for _ in range(3):
            r = await agent.turn(gw)
            assert r.status_code == 200
            agent.take(r.json())
        assert (
            await gw.post("/v1/policy/version", json={"version": 7}, headers=ADMIN)
        ).status_code == 200
        r = await gw.post(
            "/v1/rollouts/r1/exit", json={"exit_code": 3},
            headers={"Authorization": f"Bearer {agent.key}"},
        )  # fmt: skip
        assert r.status_code == 200
        before = (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        last_answer = agent.answers[-1]
    async with running(app, make_store()) as gw:
        # The trajectory, the counters and the key are back.
        after = (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert tokens_of(after) == tokens_of(before)
        assert after["num_turns"] == 3 and after["status"] == "active"
        # A retry of the last turn (its answer lost with the old process) gets that answer.
        calls = len(upstream.requests)
        agent.messages = agent.messages[:-2]  # as before the last answer
        retried = await agent.turn(gw, RETRY)
        assert retried.status_code == 200
        assert retried.json() == last_answer  # the same completion, id and all
        assert len(upstream.requests) == calls
        agent.take(retried.json())
        agent.answers.pop()
        # The next turns extend the restored history and ids: no break, no rewrite.
        for _ in range(2):
            r = await agent.turn(gw)
            assert r.status_code == 200, r.text
            agent.take(r.json())
        trajectory = (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert trajectory["num_turns"] == 5
        steps = trajectory["trajectory"]
        assert not any(s["extras"].get("history_rewritten") for s in steps)
        assert not any(s["extras"].get("prefix_break") for s in steps[1:])
        assert [s["extras"]["policy_version"] for s in steps[3:]] == [7, 7]
        # The turn limit counted the turns from before the restart.
        refused = await agent.turn(gw)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "max_turns_reached"
        # The policy version and the exit report survived.
        assert (await gw.get("/v1/policy/version", headers=ADMIN)).json()["version"] == 7
        exits = (await gw.get("/v1/rollouts/exits?after=0", headers=ADMIN)).json()
        assert [(e["rollout_id"], e["exit_code"]) for e in exits["exits"]] == [("r1", 3)]


async def test_an_idempotency_key_retry_after_a_restart_gets_the_stored_answer(
    make_store: Any,
) -> None:
    upstream = RecordingUpstream()
    app = upstream.app()
    async with running(app, make_store()) as gw:
        r = await gw.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        agent = Agent(r.json()["api_key"])
        first = await agent.turn(gw, {"Idempotency-Key": "turn-1"})
    async with running(app, make_store()) as gw:
        again = await agent.turn(gw, {"Idempotency-Key": "turn-1"})
        assert again.json() == first.json()
        assert len(upstream.requests) == 1
        # Without retry marks or a key, the same body after its answer is a new turn.
        new = await agent.turn(gw)
        assert new.status_code == 200 and len(upstream.requests) == 2


async def test_unregistered_and_cancelled_rollouts_stay_so(make_store: Any) -> None:
    app = RecordingUpstream().app()
    async with running(app, make_store()) as gw:
        for rollout_id in ("gone", "cancelled", "kept"):
            r = await gw.post(
                f"/v1/rollouts/{rollout_id}/register", json={"model": "m"}, headers=ADMIN
            )
            assert r.status_code == 200
        assert (await gw.post("/v1/rollouts/gone/unregister", headers=ADMIN)).status_code == 200
        assert (await gw.post("/v1/rollouts/cancelled/cancel", headers=ADMIN)).status_code == 200
    async with running(app, make_store()) as gw:
        assert (await gw.get("/v1/rollouts/gone/trajectory", headers=ADMIN)).status_code == 404
        cancelled = (await gw.get("/v1/rollouts/cancelled/trajectory", headers=ADMIN)).json()
        assert cancelled["status"] == "cancelled"
        assert (await gw.get("/v1/rollouts/kept/trajectory", headers=ADMIN)).status_code == 200
        health = (await gw.get("/health", headers=ADMIN)).json()
        assert health["active_rollouts"] == 2
        # A re-registration of the unregistered id starts afresh.
        r = await gw.post("/v1/rollouts/gone/register", json={"model": "m"}, headers=ADMIN)
        assert r.status_code == 200


async def test_rollouts_idle_past_their_ttl_expire_after_a_restart(tmp_path: Path) -> None:
    app = RecordingUpstream().app()
    store = tmp_path / "state"
    async with running(app, SQLiteStore(store)) as gw:
        await gw.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
    async with running(app, SQLiteStore(store), rollout_ttl_s=0.001) as gw:
        gw_app: Any = gw._transport.app  # type: ignore[attr-defined]
        assert gw_app.state.gateway.sweep() == 1
    async with running(app, SQLiteStore(store)) as gw:
        assert (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).status_code == 404


async def test_restored_rollouts_follow_the_gateways_retry_window(make_store: Any) -> None:
    app = RecordingUpstream().app()
    async with running(app, make_store(), retry_dedupe_window_s=33) as gw:
        await gw.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
    async with running(app, make_store(), retry_dedupe_window_s=7) as gw:
        gateway: Any = gw._transport.app.state.gateway  # type: ignore[attr-defined]
        record = gateway.registry.get("r1")
        assert record.turns.window_s == 7  # this gateway's setting, not the default
        assert record.turns.clock is gateway.registry.clock


class Counting:
    """Counts the store calls a turn may skip (reading the rollout, its stored answer)."""

    loads = 0
    answers_read = 0

    async def load_rollout(self, rollout_id: str) -> Any:
        self.loads += 1
        return await super().load_rollout(rollout_id)  # type: ignore[misc]

    async def load_answer(self, rollout_id: str) -> Any:
        self.answers_read += 1
        return await super().load_answer(rollout_id)  # type: ignore[misc]


class CountingStore(Counting, MemoryStore):
    """A memory store this process alone writes, counting."""


class CountingSharedStore(Counting, SharedMemoryStore):
    """A memory store gateways share, counting."""


async def test_a_private_stores_turns_skip_the_claim_until_the_copy_is_not_current() -> None:
    """On a store only this process writes, a turn whose rollout's copy is current (the
    turn tracker holding its last turn) skips the claim and the stored-answer check; a
    restored copy goes through both, and a retry from before the restart still gets its
    stored answer."""
    upstream = RecordingUpstream()
    app = upstream.app()
    store = CountingStore()
    async with running(app, store) as gw:
        r = await gw.post(
            "/v1/rollouts/r1/register", json={"model": "m", "max_turns": 10}, headers=ADMIN
        )
        agent = Agent(r.json()["api_key"])
        for _ in range(3):
            r = await agent.turn(gw)
            assert r.status_code == 200
            agent.take(r.json())
        # The registration's record is loaded and current: no turn read the store.
        assert store.loads == 0 and store.answers_read == 0
        last_answer = agent.answers[-1]
    async with running(app, store) as gw:  # restored: not current until claimed
        agent.messages = agent.messages[:-2]
        retried = await agent.turn(gw, RETRY)
        assert retried.status_code == 200
        assert retried.json() == last_answer
        assert store.loads == 1 and store.answers_read == 1
        agent.take(retried.json())
        r = await agent.turn(gw)
        assert r.status_code == 200
        assert store.loads == 1  # current again: the next turn skips it
        trajectory = (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert trajectory["num_turns"] == 4


@pytest.mark.parametrize("shared", [False, True])
async def test_a_private_current_copy_takes_no_store_call_for_its_turn(shared: bool) -> None:
    """Claim, stored answer and release reach the store only where they must: never for
    a store this process alone writes whose copy is loaded and current, with the turn
    tracker holding the rollout's last turn (a retry of it is matched there); always on a
    shared store, where another gateway may have moved the rollout on."""
    store = CountingSharedStore() if shared else CountingStore()
    rollouts = StoredRollouts(
        RolloutRegistry(max_rollouts=10, ttl_s=60), store, coordination(store),
        owner="gw", lease_s=10, retry_window_s=60,
    )  # fmt: skip
    record = RolloutRecord("r1", "m", {}, 10, None, UPSTREAM, last_activity=0.0)
    await rollouts.register(record)
    record.turns.last = Turn(b"f", None)
    await rollouts.claim(record)
    assert await rollouts.repeated_answer(record, b"f", None, is_retry=True) is None
    await rollouts.release(record)
    assert store.loads == (1 if shared else 0) and store.answers_read == 0
    record.revision = -1  # a failed write: reloaded under the claim, shared or not
    await rollouts.claim(record)
    await rollouts.release(record)
    assert store.loads == (2 if shared else 1)
