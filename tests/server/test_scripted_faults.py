"""The scripted model's faults on purpose and its ledger of served completions (soak runs)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.scripted.faults import FaultPlan, Ledger, completion_digest
from rollout_gateway.server import running_server

from .conftest import script

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": script({"say": "hello there"})}],
    "return_token_ids": True,
}


def client(**fields) -> httpx.AsyncClient:
    app = create_scripted_model_app(**fields)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://model")


def test_a_plan_draws_the_same_faults_from_the_same_seed() -> None:
    plan, again = (FaultPlan(error_rate=0.2, slow_rate=0.2, drop_rate=0.2, seed=5) for _ in "ab")
    first = [plan.draw() for _ in range(200)]
    assert first == [again.draw() for _ in range(200)]
    assert {"error", "slow", "drop", None} == set(first)
    with pytest.raises(ValueError, match="drop_rate"):
        FaultPlan(drop_rate=1.5)


async def test_every_served_completion_is_in_the_ledger_with_its_serial(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "served.jsonl")
    async with client(ledger=ledger) as model:
        answers = [(await model.post("/v1/chat/completions", json=BODY)).json() for _ in "ab"]
        streamed = await model.post("/v1/chat/completions", json={**BODY, "stream": True})
        assert streamed.text.endswith("data: [DONE]\n\n")
    lines = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    serials = [a["usage"]["call"] for a in answers]
    assert [line["call"] for line in lines][:2] == serials and len(set(serials)) == 2
    assert len(lines) == 3
    ids = answers[0]["choices"][0]["token_ids"]
    assert lines[0]["completion"] == completion_digest(ids)
    # A restarted model numbers on past every serial it gave before.
    assert Ledger(tmp_path / "other.jsonl").stamp({}) > max(serials)


async def test_errors_and_drops_are_not_served(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "served.jsonl")
    async with client(faults=FaultPlan(error_rate=1.0), ledger=ledger) as model:
        r = await model.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    app = create_scripted_model_app(faults=FaultPlan(drop_rate=1.0), ledger=ledger)
    async with running_server(app) as root, httpx.AsyncClient(base_url=root) as model:
        for stream in (False, True):  # over a real connection: the body stops short
            with pytest.raises(httpx.RemoteProtocolError):
                await model.post("/v1/chat/completions", json={**BODY, "stream": stream})
    assert not (tmp_path / "served.jsonl").exists()


async def test_a_slow_answer_takes_its_time() -> None:
    import time

    async with client(faults=FaultPlan(slow_rate=1.0, slow_s=0.3)) as model:
        started = time.monotonic()
        assert (await model.post("/v1/chat/completions", json=BODY)).status_code == 200
        assert time.monotonic() - started >= 0.3


def test_the_command_line_builds_the_plan_and_the_ledger(tmp_path: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "rollout_gateway.cli", "scripted-model", "--fault-error-rate", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--fault-error-rate: must be a number in [0, 1]" in r.stderr
