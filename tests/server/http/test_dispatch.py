"""The lean path: agents' chat routes skip Starlette's layers, everything else reaches them
(``server/http/dispatch.py``, ``server/agents/endpoint.py``, ``server/agents/request.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.applications import Starlette

from rollout_gateway.protocol import error_code
from rollout_gateway.server.agents.request import AgentRequest

from ..conftest import UPSTREAM, GatewayHarness, script

MESSAGES = [{"role": "user", "content": script({"say": "hi"})}]


def spy_on_starlette(gw: GatewayHarness) -> list[tuple[str, str]]:
    """Record (method, path) of every request that reaches Starlette's middleware stack."""
    app = gw.app
    stack = app.build_middleware_stack()
    seen: list[tuple[str, str]] = []

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append((scope["method"], scope["path"]))
        await stack(scope, receive, send)

    app.middleware_stack = spy
    return seen


async def test_chat_routes_take_the_lean_path_and_every_other_request_reaches_starlette(
    gw: GatewayHarness,
) -> None:
    seen = spy_on_starlette(gw)
    assert (await gw.register("r1")).status_code == 200
    assert (await gw.chat("r1", MESSAGES)).status_code == 200
    keyed = await gw.client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES},
        headers=gw.agent_headers("r1"),
    )
    assert keyed.status_code == 200 and keyed.json()["choices"][0]["message"]["content"]
    assert seen == [("POST", "/v1/rollouts/r1/register")]  # neither chat call went there

    seen.clear()
    assert (await gw.trajectory("r1")).json()["num_turns"] == 2
    assert (await gw.client.get("/health")).status_code == 200
    # Other methods on the chat paths: Starlette's routing answers 405.
    wrong = await gw.client.get("/v1/rollouts/r1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert (await gw.client.get("/v1/chat/completions")).status_code == 405
    # Look-alike paths are routed (and refused) by Starlette as before.
    assert (await gw.client.post("/v1/rollouts/r1/chat/completions/")).status_code != 200
    assert (await gw.client.post("/v1/rollouts//chat/completions")).status_code == 404
    encoded = await gw.client.post("/v1/rollouts/r%41/chat/completions", json={})
    assert encoded.status_code == 400 and encoded.json()["error"]["code"] == "invalid_rollout_id"
    assert [path for _, path in seen] == [
        "/v1/rollouts/r1/trajectory",
        "/health",
        "/v1/rollouts/r1/chat/completions",
        "/v1/chat/completions",
        "/v1/rollouts/r1/chat/completions/",
        "/v1/rollouts//chat/completions",
        "/v1/rollouts/rA/chat/completions",
    ]


async def test_lean_path_refusals_have_the_gateway_error_shape_and_are_counted(
    make_gateway,
) -> None:
    gw = await make_gateway(max_body_bytes=4096)
    seen = spy_on_starlette(gw)
    await gw.register("r1")
    cases = [
        (await gw.chat("r1", MESSAGES, headers={"Authorization": ""}), 401, None),
        (await gw.chat("nobody", MESSAGES), 404, "rollout_not_found"),
        (await gw.chat("bad.id", MESSAGES), 400, "invalid_rollout_id"),
        (await gw.chat("r1", {"messages": []}), 400, None),
        (await gw.chat("r1", [{"role": "user", "content": "x" * 5000}]), 413, None),
        (await gw.client.post("/v1/chat/completions", json={"messages": MESSAGES}), 401, None),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "code"}
        assert error["code"] == (code or error_code(status))  # always a string
        assert "Error" not in error["message"] and "<" not in error["message"]
    assert seen == [("POST", "/v1/rollouts/r1/register")]
    metrics = (await gw.client.get("/metrics")).text
    assert 'rollout_gateway_rejected_requests_total{status="401"} 2' in metrics
    assert 'rollout_gateway_rejected_requests_total{status="413"} 1' in metrics
    assert "rollout_gateway_internal_errors_total 0" in metrics


class ExplodingTransport(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("secret internal state")


async def test_lean_path_internal_error_is_short_closes_and_is_counted(make_gateway) -> None:
    gw = await make_gateway({UPSTREAM: ExplodingTransport()})
    seen = spy_on_starlette(gw)
    await gw.register("r1")
    for response in (
        await gw.chat("r1", MESSAGES),
        await gw.client.post(
            "/v1/chat/completions", json={"messages": MESSAGES}, headers=gw.agent_headers("r1")
        ),
    ):
        assert response.status_code == 500
        assert response.json()["error"]["message"].startswith("internal gateway error (id ")
        assert "secret" not in response.text
        assert response.headers["connection"] == "close"
    assert seen == [("POST", "/v1/rollouts/r1/register")]
    assert "rollout_gateway_internal_errors_total 2" in (await gw.client.get("/metrics")).text


async def call_asgi(app: Any, scope: dict[str, Any], messages: list[dict[str, Any]]) -> list[Any]:
    """Run one request through ``app`` directly; the messages it sent. After
    ``messages``, ``receive`` waits forever (a client waiting for its answer)."""
    incoming = iter(messages)
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        for message in incoming:
            return message
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def chat_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "server": ("gateway", 80),
        "client": ("127.0.0.1", 1),
    }


async def test_an_agent_gone_while_sending_its_body_is_not_an_internal_error(
    gw: GatewayHarness,
) -> None:
    await gw.register("r1")
    key = gw.keys["r1"].encode()
    headers = [(b"authorization", b"Bearer " + key), (b"content-type", b"application/json")]
    for path in ("/v1/rollouts/r1/chat/completions", "/v1/chat/completions"):
        sent = await call_asgi(
            gw.app,
            chat_scope(path, headers),
            [
                {"type": "http.request", "body": b'{"messages": [', "more_body": True},
                {"type": "http.disconnect"},
            ],
        )
        assert sent[0]["status"] == 499
    metrics = (await gw.client.get("/metrics")).text
    assert "rollout_gateway_internal_errors_total 0" in metrics
    assert (await gw.trajectory("r1")).json()["num_turns"] == 0


async def test_starlette_mount_of_the_chat_endpoint_answers_the_same(gw: GatewayHarness) -> None:
    """Both ways to the chat endpoint (lean dispatch, Starlette's router) are one code."""
    await gw.register("r1")
    key = gw.keys["r1"].encode()
    body = httpx.Request("POST", "http://x", json={"messages": MESSAGES}).read()
    headers = [(b"authorization", b"Bearer " + key), (b"content-length", b"%d" % len(body))]
    request = [{"type": "http.request", "body": body, "more_body": False}]
    lean = await call_asgi(gw.app, chat_scope("/v1/rollouts/r1/chat/completions", headers), request)
    routed = await call_asgi(
        lambda *a: Starlette.__call__(gw.app, *a),
        chat_scope("/v1/rollouts/r1/chat/completions", headers),
        request,
    )
    assert lean[0]["status"] == routed[0]["status"] == 200
    assert dict(lean[0]["headers"]) == dict(routed[0]["headers"])
    assert (await gw.trajectory("r1")).json()["num_turns"] == 2


def test_agent_request_reads_the_first_of_each_header() -> None:
    scope = chat_scope(
        "/v1/chat/completions",
        [
            (b"authorization", b"Bearer k1"),
            (b"authorization", b"Bearer k2"),
            (b"idempotency-key", b"abc"),
            (b"x-stainless-retry-count", b"2"),
            (b"content-length", b"12"),
        ],
    )
    request = AgentRequest(scope, receive=None)  # type: ignore[arg-type]
    assert request.bearer == "k1"
    assert (request.idempotency_key, request.content_length) == ("abc", "12")
    assert request.is_retry
    basic = chat_scope("/", [(b"authorization", b"Basic x")])
    bare = AgentRequest(basic, receive=None)  # type: ignore[arg-type]
    assert bare.bearer is None and not bare.is_retry and bare.idempotency_key is None
