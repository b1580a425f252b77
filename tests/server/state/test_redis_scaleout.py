"""Three gateway processes on one Redis behind HAProxy (round robin, no stickiness), as a
deployment runs them: real ``redis-server``, real ``haproxy``, real ``kill -9``
(``tests/support/local_cluster.py``).

The env side is the project's own (:class:`~rollout_gateway.client.GatewayClient`,
:class:`~rollout_gateway.exits.ExitWatcher`) and the agents are the OpenAI SDK, all given
the balancer's URL and nothing else. Every turn of a rollout may land on any gateway and
the trajectories equal one gateway's, token for token; two requests of one rollout never
run at once; a retry racing its original gets the original's answer; a gateway killed
mid-run loses no rollout; exit reports reach an env whichever gateway took them; Redis
killed mid-run fails turns with a 503 the SDK retries, and nothing stored is lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from support.local_cluster import GatewayGroup, HAProxy, RedisServer

from rollout_gateway.client import GatewayClient
from rollout_gateway.exits import ExitWatcher
from rollout_gateway.protocol import rollout_base_url
from rollout_gateway.scripted import build_completion
from rollout_gateway.server import GatewayConfig, create_app, server_thread

from .redis_fixtures import require_redis_server

openai = pytest.importorskip("openai")
pytest.importorskip("redis")

ADMIN = "scaleout-admin-token-0123456789abcdef"
TURNS = 6
#: Added to every completion: long enough for requests of many rollouts to overlap.
LATENCY_S = 0.05
#: A request whose last message holds this marker takes this long.
SLOW, SLOW_S = "[slow]", 1.5


def _require_haproxy() -> None:
    if not (os.path.exists("/usr/sbin/haproxy") or shutil.which("haproxy")):
        if os.environ.get("CI"):
            pytest.fail("haproxy is not installed: .ci/run installs it")
        pytest.skip("haproxy is not installed (apt-get install haproxy)")


@dataclass
class Model:
    """The scripted model, counting each rollout's requests and how many ran at once."""

    requests: Counter[str] = field(default_factory=Counter)
    running: Counter[str] = field(default_factory=Counter)
    most_at_once: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            tag = str(body["messages"][0]["content"])  # the rollout's task: unique
            with self.lock:
                self.requests[tag] += 1
                self.running[tag] += 1
                self.most_at_once[tag] = max(self.most_at_once[tag], self.running[tag])
            try:
                slow = SLOW in str(body["messages"][-1].get("content"))
                await asyncio.sleep(SLOW_S if slow else LATENCY_S)
                return JSONResponse(build_completion(body, "policy"))
            finally:
                with self.lock:
                    self.running[tag] -= 1

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "policy", "object": "model"}]})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )


@dataclass
class Cluster:
    redis: RedisServer
    gateways: GatewayGroup
    lb: HAProxy
    #: One gateway alone, in memory: the trajectories to equal.
    alone: str
    model: Model


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_redis_server()
    _require_haproxy()
    directory = tmp_path_factory.mktemp("scaleout")
    model = Model()
    with server_thread(model.app()) as model_root:
        upstream = f"{model_root}/v1"
        config = GatewayConfig(upstreams=[upstream], admin_token=ADMIN)
        with (
            server_thread(create_app(config)) as alone,
            RedisServer(directory / "redis") as redis,
            GatewayGroup(
                redis.url, upstream, 3, directory / "gateways", admin_token=ADMIN,
                extra_args=["--redis-lease", "2"],
            ) as gateways,
            HAProxy(gateways.ports, directory / "lb") as lb,
        ):  # fmt: skip
            yield Cluster(redis, gateways, lb, alone, model)


def _task(rollout_id: str, turns: int = TURNS, marker: str = "") -> str:
    steps = [{"tool": "run", "arguments": {"cmd": f"step {i}"}} for i in range(turns - 1)]
    steps.append({"say": "done"})
    return f"{marker}Task of {rollout_id}. <script>{json.dumps(steps)}</script>"


@dataclass
class Rollout:
    rollout_id: str
    #: Which gateway answered each turn (the balancer's ``X-Gateway``), and when.
    served_by: list[str] = field(default_factory=list)
    served_at: list[float] = field(default_factory=list)
    trajectory: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None


async def run_rollout(
    root: str,
    rollout_id: str,
    *,
    watcher: ExitWatcher | None = None,
    turns: int = TURNS,
    result: Rollout | None = None,
) -> Rollout:
    """One rollout as an env and its agent run it against the gateway at ``root``:
    register (GatewayClient), the agent's turns (the OpenAI SDK, retrying as it does), its
    exit report, the env's wait for it (ExitWatcher), the trajectory, unregister."""
    result = result or Rollout(rollout_id)
    async with GatewayClient(root, admin_token=ADMIN) as env:
        registered = await env.register(rollout_id, model="policy")
        exited = watcher.subscribe(rollout_id) if watcher is not None else None
        agent = openai.AsyncOpenAI(
            base_url=rollout_base_url(root, rollout_id),
            api_key=registered["api_key"],
            max_retries=6,
            timeout=60,
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": _task(rollout_id, turns)}]
        try:
            for _ in range(turns):
                raw = await agent.chat.completions.with_raw_response.create(
                    model="policy",
                    messages=messages,  # type: ignore[arg-type]
                )
                result.served_by.append(raw.headers.get("x-gateway", "alone"))
                result.served_at.append(time.monotonic())
                message = raw.parse().choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls or ():
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
            headers = {"Authorization": f"Bearer {registered['api_key']}"}
            async with httpx.AsyncClient(timeout=30) as http:  # the launch wrapper's report
                r = await http.post(
                    f"{rollout_base_url(root, rollout_id)}/exit", json={"exit_code": 0},
                    headers=headers,
                )  # fmt: skip
                assert r.status_code == 200, r.text
        finally:
            await agent.close()
        if exited is not None:
            result.exit_code = await asyncio.wait_for(exited, 30)
        result.trajectory = dict(await env.get_trajectory(rollout_id))
        await env.unregister(rollout_id)
    return result


def comparable(trajectory: dict[str, Any]) -> list[Any]:
    """What must be equal token for token: each step's messages, ids, logprobs, mask and
    flags (not the completions' random ids)."""
    return [
        (s["prompt"], s["completion"], s["tokens"], s["is_truncated"])
        for s in trajectory["trajectory"]
    ]


@pytest.fixture
async def watcher(cluster: Cluster) -> AsyncIterator[ExitWatcher]:
    """The env's exit watcher, on the balancer (its stream lands on any one gateway)."""
    async with GatewayClient(cluster.lb.root, admin_token=ADMIN) as client:
        watcher = ExitWatcher(client)
        yield watcher
        await watcher.aclose()


async def test_any_turn_on_any_gateway_records_one_gateways_trajectory(
    cluster: Cluster, watcher: ExitWatcher
) -> None:
    ids = [f"spread-{i}" for i in range(7)]
    spread = await asyncio.gather(*(run_rollout(cluster.lb.root, i, watcher=watcher) for i in ids))
    alone = await asyncio.gather(*(run_rollout(cluster.alone, i) for i in ids))
    for shared, single in zip(spread, alone, strict=True):
        assert shared.trajectory["num_turns"] == TURNS
        assert comparable(shared.trajectory) == comparable(single.trajectory)
        # Round robin with no stickiness: a rollout's turns went to several gateways.
        assert len(set(shared.served_by)) >= 2, shared.served_by
        # Its exit report, taken by some gateway, reached the env's one exit stream.
        assert shared.exit_code == 0
    assert {g for r in spread for g in r.served_by} == {"gateway0", "gateway1", "gateway2"}
    assert all(cluster.model.most_at_once[_task(i)] == 1 for i in ids)


async def test_a_retry_racing_its_original_gets_the_originals_answer(cluster: Cluster) -> None:
    async with GatewayClient(cluster.lb.root, admin_token=ADMIN) as env:
        key = (await env.register("race", model="policy"))["api_key"]
        url = f"{rollout_base_url(cluster.lb.root, 'race')}/chat/completions"
        task = _task("race", 2, marker=SLOW)
        body = {"model": "policy", "messages": [{"role": "user", "content": task}]}
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=30) as http:
            original = asyncio.ensure_future(http.post(url, json=body, headers=headers))
            await asyncio.sleep(0.4)  # the original's turn runs at one gateway
            retry = await http.post(
                url, json=body, headers={**headers, "x-stainless-retry-count": "1"}
            )
            first = await original
        assert first.status_code == retry.status_code == 200
        assert first.headers["x-gateway"] != retry.headers["x-gateway"]  # two gateways
        assert retry.json() == first.json()  # the same completion: not sampled again
        assert cluster.model.requests[task] == 1
        # Two different requests of one rollout at once: never run at once anywhere.
        answered = first.json()["choices"][0]["message"]
        follow = {"role": "user", "content": f"{SLOW} and then?"}
        bodies = [
            {"model": "policy", "messages": [*body["messages"], answered, follow]},
            {"model": "policy", "messages": [*body["messages"], {"role": "user", "content": SLOW}]},
        ]
        async with httpx.AsyncClient(timeout=30) as http:
            both = await asyncio.gather(*(http.post(url, json=b, headers=headers) for b in bodies))
        assert [r.status_code for r in both] == [200, 200]
        assert len({r.headers["x-gateway"] for r in both}) == 2
        assert cluster.model.most_at_once[task] == 1
        trajectory = await env.get_trajectory("race")
        assert trajectory["num_turns"] == 3
        await env.unregister("race")


async def test_exit_reports_and_long_polls_across_gateways(cluster: Cluster) -> None:
    async with GatewayClient(cluster.lb.root, admin_token=ADMIN) as env:
        keys = {}
        for rollout_id in ("poll-a", "poll-b"):
            keys[rollout_id] = (await env.register(rollout_id, model="policy"))["api_key"]
        start = (await env.wait_exits(0, 0))["cursor"]
        waiting = asyncio.ensure_future(env.wait_exits(start, 20))  # held by one gateway
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=30) as agent:
            for rollout_id, code in (("poll-a", 3), ("poll-b", 0)):
                r = await agent.post(
                    f"{rollout_base_url(cluster.lb.root, rollout_id)}/exit",
                    json={"exit_code": code},
                    headers={"Authorization": f"Bearer {keys[rollout_id]}"},
                )  # each to the next gateway
                assert r.status_code == 200
        first = await asyncio.wait_for(waiting, 20)
        assert first["exits"][0]["rollout_id"] == "poll-a"
        assert first["exits"][0]["exit_code"] == 3
        # One numbering: from the same cursor, every gateway answers the same reports
        # (each hears of the others' within moments).
        for root in cluster.gateways.roots():
            async with GatewayClient(root, admin_token=ADMIN) as one:
                deadline = time.monotonic() + 10
                while len((answer := await one.wait_exits(start, 5))["exits"]) < 2:
                    assert time.monotonic() < deadline, answer
                    await asyncio.sleep(0.02)
            assert [(r["rollout_id"], r["exit_code"]) for r in answer["exits"]] == [
                ("poll-a", 3), ("poll-b", 0),
            ]  # fmt: skip
            assert answer["cursor"] == start + 2
        for rollout_id in keys:
            await env.unregister(rollout_id)


async def test_a_gateway_killed_mid_run_loses_no_rollout(cluster: Cluster) -> None:
    ids = [f"kill-{i}" for i in range(6)]
    progress = [Rollout(i) for i in ids]
    runs = asyncio.gather(
        *(run_rollout(cluster.lb.root, r.rollout_id, turns=8, result=r) for r in progress)
    )
    while not any("gateway1" in r.served_by for r in progress):  # it serves them...
        await asyncio.sleep(0.01)
    victim = cluster.gateways.pids()[1]
    cluster.gateways.kill(1)  # ... and is killed (kill -9) with turns in flight
    killed_at = time.monotonic()
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)
    spread = await runs
    assert all(len(r.served_at) == 8 and r.served_at[-1] > killed_at for r in spread)
    alone = await asyncio.gather(*(run_rollout(cluster.alone, i, turns=8) for i in ids))
    for shared, single in zip(spread, alone, strict=True):
        # Every rollout completed, each turn recorded once, as one gateway records it.
        assert shared.trajectory["num_turns"] == 8
        assert comparable(shared.trajectory) == comparable(single.trajectory)
    assert all(cluster.model.most_at_once[_task(i, 8)] == 1 for i in ids)
    cluster.gateways.start_one(1)  # back: it serves rollouts it never saw
    again = await run_rollout(cluster.lb.root, "after-restart")
    assert again.trajectory["num_turns"] == TURNS


async def retried_on_503(turn: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """``turn``'s answer, retried (up to 10 times) on a 503 ``store_unavailable``, as any
    client does. (Pooled connections that Redis closed are reconnected before use, so a
    503 after Redis is back is not expected; the retry keeps a loaded machine's slow
    reconnection from failing the test, which checks what is stored.)"""
    for _ in range(9):
        answer = await turn()
        if answer.status_code != 503:
            return answer
        assert answer.json()["error"]["code"] == "store_unavailable"
        await asyncio.sleep(0.2)
    return await turn()


async def test_redis_lost_mid_run_fails_turns_with_a_503_and_loses_nothing_stored(
    cluster: Cluster,
) -> None:
    async with GatewayClient(cluster.lb.root, admin_token=ADMIN) as env:
        key = (await env.register("outage", model="policy"))["api_key"]
        agent = httpx.AsyncClient(
            base_url=rollout_base_url(cluster.lb.root, "outage"),
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        messages: list[Any] = [{"role": "user", "content": _task("outage", 4)}]

        async def turn() -> httpx.Response:
            return await agent.post(
                "/chat/completions", json={"model": "policy", "messages": messages}
            )

        def advance(answer: httpx.Response) -> None:
            message = answer.json()["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            for call in message.get("tool_calls") or ():
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})

        for _ in range(2):
            answer = await turn()
            assert answer.status_code == 200
            advance(answer)
        before = comparable(dict(await env.get_trajectory("outage")))
        cluster.redis.kill()  # kill -9: the gateways' connections drop
        refused = Counter()
        for _ in range(3):  # whichever gateway takes it
            answer = await turn()
            refused[(answer.status_code, answer.json()["error"]["code"])] += 1
        assert refused == Counter({(503, "store_unavailable"): 3})
        # The OpenAI SDK retries a 503; Redis comes back while it does.
        sdk = openai.AsyncOpenAI(
            base_url=rollout_base_url(cluster.lb.root, "outage"), api_key=key, max_retries=8
        )
        late = asyncio.ensure_future(
            sdk.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
        )
        await asyncio.sleep(1.0)
        cluster.redis.restart()  # same data (an append-only file synced on every write)
        completion = await asyncio.wait_for(late, 60)
        messages.append(completion.choices[0].message.model_dump(exclude_none=True))
        for call in completion.choices[0].message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
        answer = await retried_on_503(turn)
        assert answer.status_code == 200
        await sdk.close()
        await agent.aclose()
        after = comparable(dict(await env.get_trajectory("outage")))
        assert after[:2] == before and len(after) == 4  # what was stored is all there
        await env.unregister("outage")
