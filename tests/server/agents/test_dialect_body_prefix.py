"""A dialect body parsed from the previous body's bytes
(:mod:`~rollout_gateway.server.http.body_prefix`) reaches the engine and the trajectory
as a whole parse of it does."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from rollout_gateway.server.http.body_prefix import UNWRITTEN

from ..conftest import RecordingUpstream

SYSTEM = "You are an agent. " + "é\x00 x" * 5000  # long: the history goes as a view


def conversation(dialect: str, turns: int, rewrite: bool) -> dict[str, Any]:
    """The body of the turn after ``turns`` exchanges (``rewrite``: the first user
    message one byte off)."""
    first = "List the files." if not rewrite else "List the filez."
    users = [first] + [f"Go on ({i})." for i in range(turns)]
    if dialect == "anthropic":
        messages: list[Any] = []
        for i, user in enumerate(users):
            messages.append({"role": "user", "content": [{"type": "text", "text": user}]})
            if i < turns:
                messages.append({"role": "assistant", "content": [
                    {"type": "text", "text": f"Said {i}."}]})  # fmt: skip
        return {"model": "m", "max_tokens": 64, "system": SYSTEM, "messages": messages}
    items: list[Any] = [{"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": SYSTEM}]}]  # fmt: skip
    for i, user in enumerate(users):
        items.append({"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": user}]})  # fmt: skip
        if i < turns:
            items.append({"type": "message", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": f"Said {i}.",
                                       "annotations": []}]})  # fmt: skip
    return {"model": "m", "input": items, "store": False, "max_output_tokens": 64}


def without_ids(value: Any, rollout: str) -> Any:
    """``value`` (a trajectory) without its rollout's id, its own id and its timings."""
    if isinstance(value, dict):
        return {
            key: without_ids(item, rollout)
            for key, item in value.items()
            if key != "trajectory_id" and not key.endswith(("_at", "_s"))
        }
    if isinstance(value, list):
        return [without_ids(item, rollout) for item in value]
    return "ROLLOUT" if value == rollout else value


@pytest.mark.parametrize("dialect", ["anthropic", "responses"])
async def test_a_body_parsed_from_the_previous_ones_reaches_the_engine_as_a_whole_parse(
    make_gateway: Any, dialect: str
) -> None:
    """One rollout's agent writes its bodies as orjson does (each parsed from the
    previous one's bytes), another's with spaces (each parsed whole): the engine gets the
    same bytes, and the trajectories are the same, through a history one byte off."""
    upstream = RecordingUpstream()
    gw = await make_gateway(upstream.app())
    path = "v1/messages" if dialect == "anthropic" else "responses"
    for rollout in ("chained", "whole"):
        await gw.register(rollout)
    plan = [(0, False), (1, False), (2, False), (3, True), (4, True), (5, False)]
    for turns, rewrite in plan:
        body = conversation(dialect, turns, rewrite)
        sent: dict[str, bytes] = {
            "chained": orjson.dumps(body), "whole": json.dumps(body, indent=1).encode()
        }  # fmt: skip
        answers = []
        for rollout, raw in sent.items():
            headers = {"x-api-key": gw.keys[rollout], "content-type": "application/json"}
            if dialect == "responses":
                headers = gw.agent_headers(rollout, {"content-type": "application/json"})
            r = await gw.client.post(f"/v1/rollouts/{rollout}/{path}", content=raw, headers=headers)
            assert r.status_code == 200, r.text
            answers.append(r.json())
        assert upstream.bodies[-1] == upstream.bodies[-2]
        prefix = gw.gateway.registry.get("chained").body_prefix
        assert prefix is not None and prefix.raw == sent["chained"]  # each from the last
        assert gw.gateway.registry.get("whole").body_prefix is UNWRITTEN
    trajectories = [(await gw.trajectory(r)).json() for r in ("chained", "whole")]
    assert len(trajectories[0]["trajectory"]) == len(plan)
    chained, whole = without_ids(trajectories[0], "chained"), without_ids(trajectories[1], "whole")
    assert orjson.dumps(chained) == orjson.dumps(whole)
