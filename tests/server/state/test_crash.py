"""``kill -9`` of a real gateway process on a SQLite state directory loses no turn.

A burst of 64 rollouts of 10 turns, each agent an OpenAI SDK client with retries, runs
against a ``rollout-gateway serve --state-dir`` subprocess that the test kills with
SIGKILL at random moments and restarts on the same directory at once. Every rollout
completes; every trajectory is token for token the one an uninterrupted gateway records
(ids, logprobs, masks, flags, messages); each recorded step is the very answer its agent
received (the model stamps every call with a serial number in ``usage``: a turn sampled
again after its answer was stored would show); keys, limits and the policy version
survive. A turn whose answer was stored but never taken by its agent is answered from
the store on the agent's retry (``test_a_turn_answered_before_the_kill_is_not_sampled_again``).

The random kill points come from a seed printed with the figures (``-s`` shows them);
``ROLLOUT_GATEWAY_CRASH_SEED`` replays one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from stacks import STACK
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from support.local_cluster import free_port as _free_port

from rollout_gateway import child_processes
from rollout_gateway.scripted import build_completion
from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.runner import running_server, server_thread

ADMIN_TOKEN = "crash-test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ROLLOUTS = 64
TURNS = 10
POLICY_VERSION = 3


def script_for(index: int) -> str:
    """Rollout ``index``'s task: nine tool calls (some sampled among choices) and a reply."""
    steps: list[Any] = []
    for turn in range(TURNS - 1):
        call = {"tool": "run", "arguments": {"cmd": f"r{index} step {turn}"}}
        other = {"tool": "read", "arguments": {"path": f"/f{index}/{turn}"}}
        steps.append({"one_of": [call, other]} if turn % 3 == 1 else call)
    steps.append({"say": f"done {index}"})
    return f"Crash test task {index}. <script>{json.dumps(steps)}</script>"


class CountingModel:
    """The scripted model, stamping each answer with its call's serial number
    (``usage.call``: recorded in the step's extras and seen by the agent)."""

    def __init__(self) -> None:
        self.serials = itertools.count(1)
        self.calls: list[tuple[int, float, str]] = []  # serial, time, first user text

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            completion = build_completion(body, "crash-model")
            serial = next(self.serials)
            completion["usage"]["call"] = serial
            user = next(m["content"] for m in body["messages"] if m["role"] == "user")
            self.calls.append((serial, time.monotonic(), str(user)[:40]))
            return JSONResponse(completion)

        async def models(request: Request) -> Response:
            card = {"id": "crash-model", "object": "model", "max_model_len": 65536}
            return JSONResponse({"object": "list", "data": [card]})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )


class GatewayProcess:
    """``rollout-gateway serve --state-dir`` as a subprocess this test starts and kills."""

    def __init__(self, upstream: str, state_dir: Path, log: Path) -> None:
        self.port = _free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable, "-m", "rollout_gateway.cli", "serve", "--upstream", upstream,
            "--port", str(self.port), "--state-dir", str(state_dir), "--log-level", "warning",
        ]  # fmt: skip
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts: list[float] = []

    def start(self) -> float:
        """Start it and wait until it serves; the seconds that took."""
        started = time.monotonic()
        env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
        with self.log.open("ab") as log:
            # Its own group, dead with this test process even by kill -9 (the test's
            # own kill -9 of it is what it tests: see ``kill``).
            self.proc = child_processes.spawn(self.command, env=env, stdout=log, stderr=log)
        deadline = started + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gateway exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"{self.root}/health", timeout=1).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not start")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the process this test started, and reap it."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def model() -> Iterator[tuple[CountingModel, str]]:
    counting = CountingModel()
    with server_thread(counting.app()) as root:
        yield counting, f"{root}/v1"


async def register(root: str, index: int) -> str:
    async with httpx.AsyncClient(base_url=root, headers=ADMIN, timeout=30) as control:
        r = await control.post(
            f"/v1/rollouts/crash{index}/register",
            json={
                "model": "crash-model",
                "sampling_params": {"temperature": 0.7, "seed": 1000 + index},
                "max_turns": TURNS,
                "max_total_tokens": 10**7,
            },
        )
        r.raise_for_status()
        return str(r.json()["api_key"])


async def run_agent(root: str, index: int, key: str) -> list[dict[str, Any]]:
    """One agent: ten turns through the OpenAI SDK (which retries connection errors)."""
    client = openai.AsyncOpenAI(
        base_url=f"{root}/v1/rollouts/crash{index}", api_key=key, max_retries=12, timeout=60
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": script_for(index)}]
    answers = []
    async with client:
        for _ in range(TURNS):
            completion = await client.chat.completions.create(
                model="crash-model", messages=messages,  # type: ignore[arg-type]
                logprobs=True, extra_body={"return_token_ids": True},
            )  # fmt: skip
            answer = completion.model_dump()
            answers.append(answer)
            message = {k: v for k, v in answer["choices"][0]["message"].items() if v is not None}
            messages.append(message)
            for call in message.get("tool_calls") or ():
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
    return answers


def comparable(trajectory: dict[str, Any]) -> list[Any]:
    """A trajectory less what differs between runs (timing, the model's call serials)."""
    steps = []
    for step in trajectory["trajectory"]:
        extras = {k: v for k, v in step["extras"].items() if k not in ("timing", "usage")}
        steps.append(
            (step["prompt"], step["completion"], step["tokens"], step["is_truncated"], extras)
        )
    return steps


async def uninterrupted(upstream: str) -> dict[int, dict[str, Any]]:
    """The trajectories an uninterrupted gateway (in this process, in memory) records."""
    config = GatewayConfig(upstreams=[upstream], admin_token=ADMIN_TOKEN)
    async with running_server(create_app(config)) as root:
        async with httpx.AsyncClient(base_url=root, headers=ADMIN, timeout=60) as control:
            await control.post("/v1/policy/version", json={"version": POLICY_VERSION})
            keys = [await register(root, i) for i in range(ROLLOUTS)]
            await asyncio.gather(*(run_agent(root, i, k) for i, k in enumerate(keys)))
            return {
                i: (await control.get(f"/v1/rollouts/crash{i}/trajectory")).json()
                for i in range(ROLLOUTS)
            }


@pytest.mark.skipif(
    STACK == "v1", reason="the gateway is the same on both stacks: the burst runs once, on classic"
)
async def test_kill_9_during_a_burst_loses_no_turn(
    model: tuple[CountingModel, str], tmp_path: Path
) -> None:
    counting, upstream = model
    reference = await uninterrupted(upstream)
    seed = int(os.environ.get("ROLLOUT_GATEWAY_CRASH_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    gateway = GatewayProcess(upstream, tmp_path / "state", tmp_path / "gateway.log")
    gateway.start()
    kills: list[float] = []
    try:
        async with httpx.AsyncClient(base_url=gateway.root, headers=ADMIN, timeout=60) as control:
            await control.post("/v1/policy/version", json={"version": POLICY_VERSION})
            keys = [await register(gateway.root, i) for i in range(ROLLOUTS)]
            first_call = len(counting.calls)
            agents = asyncio.gather(*(run_agent(gateway.root, i, k) for i, k in enumerate(keys)))

            async def killer() -> None:
                while not agents.done() and len(kills) < 5:
                    await asyncio.sleep(rng.uniform(0.15, 0.9))
                    if agents.done():
                        return
                    await asyncio.to_thread(gateway.kill)
                    kills.append(time.monotonic())
                    gateway.restarts.append(await asyncio.to_thread(gateway.start))

            killing = asyncio.ensure_future(killer())
            answers = await agents
            await killing
            trajectories = {
                i: (await control.get(f"/v1/rollouts/crash{i}/trajectory")).json()
                for i in range(ROLLOUTS)
            }
            policy = (await control.get("/v1/policy/version")).json()
            # Limits survived: each rollout's turn budget is spent.
            r = await control.post(
                "/v1/rollouts/crash0/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "more"}]},
                headers={"Authorization": f"Bearer {keys[0]}"},
            )
    finally:
        gateway.stop()
    calls = len(counting.calls) - first_call
    print(
        f"\ncrash test seed {seed}: {len(kills)} kills, restarts took "
        f"{', '.join(f'{s:.2f}' for s in gateway.restarts)} s; {calls} model calls for "
        f"{ROLLOUTS * TURNS} turns ({calls - ROLLOUTS * TURNS} turns in flight at a kill ran again)"
    )
    assert kills, "the burst ended before the first kill"
    assert r.status_code == 403 and r.json()["error"]["code"] == "max_turns_reached"
    assert policy["version"] == POLICY_VERSION
    for i in range(ROLLOUTS):
        trajectory = trajectories[i]
        assert trajectory["num_turns"] == TURNS, f"rollout {i}"
        assert trajectory["status"] == "completed"
        assert comparable(trajectory) == comparable(reference[i]), f"rollout {i}"
        # Each step is the answer its agent got, not another sample of the same turn.
        recorded = [step["extras"]["usage"]["call"] for step in trajectory["trajectory"]]
        received = [answer["usage"]["call"] for answer in answers[i]]
        assert recorded == received, f"rollout {i}"
        assert all(
            s["extras"]["policy_version"] == POLICY_VERSION for s in trajectory["trajectory"]
        )
    assert calls >= ROLLOUTS * TURNS


async def test_a_turn_answered_before_the_kill_is_not_sampled_again(
    model: tuple[CountingModel, str], tmp_path: Path
) -> None:
    """The answer is stored and sent; the agent never takes it (its read timed out, say);
    the gateway is killed; the agent's SDK retries: it gets that very answer."""
    counting, upstream = model
    gateway = GatewayProcess(upstream, tmp_path / "state", tmp_path / "gateway.log")
    gateway.start()
    try:
        key = await register(gateway.root, 0)
        messages = [{"role": "user", "content": 'hi <script>[{"say": "x"}]</script>'}]
        asked = {"logprobs": True, "return_token_ids": True, "messages": messages}
        body = json.dumps({"model": "crash-model", **asked}).encode()
        request = (
            f"POST /v1/rollouts/crash0/chat/completions HTTP/1.1\r\nHost: gw\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        with socket.create_connection(("127.0.0.1", gateway.port)) as agent:
            agent.sendall(request)
            agent.settimeout(30)
            assert agent.recv(1, socket.MSG_PEEK)  # the answer is on its way: it was stored
            gateway.kill()  # ...and the agent never reads it
        gateway.start()
        calls = len(counting.calls)
        async with httpx.AsyncClient(base_url=gateway.root, timeout=30) as client:
            retry = await client.post(
                "/v1/rollouts/crash0/chat/completions",
                content=body,
                headers={
                    "Authorization": f"Bearer {key}",
                    "Content-Type": "application/json",
                    "x-stainless-retry-count": "1",
                },
            )
            trajectory = (await client.get("/v1/rollouts/crash0/trajectory", headers=ADMIN)).json()
    finally:
        gateway.stop()
    assert retry.status_code == 200, retry.text
    assert len(counting.calls) == calls  # not sampled again
    answer = retry.json()
    assert answer["usage"]["call"] == counting.calls[-1][0]
    assert answer["prompt_token_ids"] == trajectory["trajectory"][0]["tokens"]["prompt_ids"]
    assert trajectory["num_turns"] == 1
    assert trajectory["trajectory"][0]["extras"]["usage"]["call"] == answer["usage"]["call"]
