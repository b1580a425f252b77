"""Every error answer of the gateway carries ``error.code`` as a string, as OpenAI's API does
(issue 25: auth and validation errors had the status number, refusals a string)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from rollout_gateway.protocol import STATUS_ERROR_CODES, TURN_REFUSAL_CODES, error_code

from .conftest import UPSTREAM, GatewayHarness, script

MESSAGES = [{"role": "user", "content": "hi"}]


class Exploding(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug")


class Failing(httpx.AsyncBaseTransport):
    """An upstream answering every chat call with a 5xx."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "policy", "object": "model"}]})
        return httpx.Response(503, json={"error": {"message": "overloaded", "code": 503}})


def _error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"}, response.text
    return error


async def test_every_error_answer_has_a_string_code(make_gateway: Any) -> None:
    gw: GatewayHarness = await make_gateway()
    anonymous = httpx.AsyncClient(transport=gw.client._transport, base_url="http://gateway")
    await gw.register("r1", max_turns=1)
    await gw.chat("r1", MESSAGES)  # the one turn it may take
    answers = {
        "control plane without the admin token": await anonymous.post(
            "/v1/rollouts/r2/register", json={"model": "policy"}
        ),
        "metrics without the admin token": await anonymous.get("/metrics"),
        "register twice": await gw.register("r1"),
        "register without a model": await gw.client.post("/v1/rollouts/r3/register", json={}),
        "register with a body that is not JSON": await gw.client.post(
            "/v1/rollouts/r3/register", content=b"{nope"
        ),
        "trajectory of an unknown rollout": await gw.trajectory("nobody"),
        "unregister of an unknown rollout": await gw.client.post("/v1/rollouts/nobody/unregister"),
        "a route that does not exist": await gw.client.get("/v1/nothing/here"),
        "a method the route does not take": await gw.client.get("/v1/rollouts/r1/register"),
        "chat without a key": await gw.chat("r1", MESSAGES, headers={"Authorization": ""}),
        "chat with another rollout's key": await gw.chat(
            "r1", MESSAGES, headers={"Authorization": "Bearer not-the-key"}
        ),
        "chat of an unknown rollout": await gw.chat("nobody", MESSAGES),
        "chat without messages": await gw.chat("r1", {"messages": []}),
        "chat past max_turns": await gw.chat("r1", [*MESSAGES, *MESSAGES]),
        "bearer-key chat without a key": await anonymous.post(
            "/v1/chat/completions", json={"messages": MESSAGES}
        ),
        "an encoded slash in the rollout id": await gw.client.post(
            "/v1/rollouts/a%2Fb/chat/completions", json={"messages": MESSAGES}
        ),
        "a stale policy version": await gw.client.post("/v1/policy/version", json={"version": -1}),
    }
    await anonymous.aclose()
    for what, response in answers.items():
        assert response.status_code >= 400, what
        code = _error(response)["code"]
        assert isinstance(code, str) and code, (what, response.text)
    assert _error(answers["control plane without the admin token"])["code"] == "unauthorized"
    assert _error(answers["a method the route does not take"])["code"] == "method_not_allowed"
    assert _error(answers["chat of an unknown rollout"])["code"] == "rollout_not_found"
    assert _error(answers["chat past max_turns"])["code"] in TURN_REFUSAL_CODES


async def test_an_internal_error_has_a_string_code(make_gateway: Any) -> None:
    gw = await make_gateway({UPSTREAM: Exploding()})
    await gw.register("r1")
    response = await gw.chat("r1", MESSAGES)
    assert response.status_code == 500 and _error(response)["code"] == "internal_error"


async def test_an_upstream_failure_has_a_string_code_whole_and_streamed(make_gateway: Any) -> None:
    gw = await make_gateway({UPSTREAM: Failing()})
    await gw.register("r1")
    whole = await gw.chat("r1", [{"role": "user", "content": script({"say": "x"})}])
    assert whole.status_code == 502 and isinstance(_error(whole)["code"], str)
    streamed = await gw.chat(
        "r1", {"messages": [{"role": "user", "content": "again"}], "stream": True}
    )
    if streamed.headers.get("content-type", "").startswith("text/event-stream"):
        events = [
            json.loads(line[len("data: ") :])
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]
        errors = [event["error"] for event in events if "error" in event]
        assert errors and all(isinstance(e["code"], str) for e in errors), streamed.text
    else:
        assert isinstance(_error(streamed)["code"], str)


def test_the_default_codes_are_the_statuses_names() -> None:
    assert error_code(401) == "unauthorized" and error_code(599) == "http_599"
    assert all(isinstance(code, str) for code in STATUS_ERROR_CODES.values())


def test_an_error_event_inside_a_stream_has_a_string_code() -> None:
    from rollout_gateway.server.engines.streaming import sse_error_event

    event = sse_error_event("upstream error 503", 503, "upstream_error")
    payload = json.loads(event.decode().removeprefix("data: "))
    assert payload["error"]["code"] == "service_unavailable"
