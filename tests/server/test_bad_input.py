"""Bad input is a 4xx and internals never reach an agent (issue 11: access findings)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollout_gateway.scripted import build_completion

from .conftest import UPSTREAM, GatewayHarness, RecordingUpstream, script

MESSAGES = [{"role": "user", "content": script({"say": "hi"})}]


def hostile_bodies() -> list[bytes]:
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',  # lone surrogate
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}',
        deep,
    ]


@pytest.mark.parametrize("raw", hostile_bodies(), ids=["surrogate", "nan", "1e400", "inf", "deep"])
async def test_hostile_json_is_400_on_chat_and_register(gw: GatewayHarness, raw: bytes) -> None:
    await gw.register("r1")
    headers = gw.agent_headers("r1", {"Content-Type": "application/json"})
    r = await gw.client.post("/v1/rollouts/r1/chat/completions", content=raw, headers=headers)
    assert r.status_code == 400, r.text
    assert "Error" not in r.json()["error"]["message"]  # no Python exception names
    r = await gw.client.post("/v1/rollouts/r2/register", content=raw)
    assert r.status_code == 400, r.text
    assert (await gw.chat("r1", MESSAGES)).status_code == 200  # still serving


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "x"}, 5],
        [{"role": "user", "content": "x"}, ["role", "user"]],
        [{"role": "user", "content": "x"}, {"content": "no role"}],
        [{"role": "user", "content": "x"}, {"role": 5, "content": "x"}],
        [{"role": None, "content": "x"}],
        [None],
    ],
    ids=["number", "list", "no-role", "role-number", "role-null", "null"],
)
async def test_a_message_that_is_not_an_object_with_a_role_is_400(
    gw: GatewayHarness, messages: list
) -> None:
    await gw.register("r1")
    r = await gw.chat("r1", messages)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "each message must be an object with a 'role'"
    assert (await gw.chat("r1", MESSAGES)).status_code == 200  # still serving


@pytest.mark.parametrize(
    "path",
    [
        "/v1/rollouts/r1%2Fx/chat/completions",
        "/v1/rollouts/r1%2fx/trajectory",
        "/v1/rollouts/..%2F..%2Fhealth/cancel",
        "/v1/rollouts/r1%2F/register",
    ],
)
async def test_encoded_slash_in_rollout_id_is_400(gw: GatewayHarness, path: str) -> None:
    await gw.register("r1")
    method = "GET" if path.endswith("trajectory") else "POST"
    r = await gw.client.request(method, path, json={"model": "m", "messages": MESSAGES})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_rollout_id"


class ExplodingTransport(httpx.AsyncBaseTransport):
    """A bug stand-in: raises something no handler expects."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("secret internal state at http://user:pw@10.0.0.1/v1")


async def test_internal_error_is_short_closes_the_connection_and_is_counted(
    make_gateway, caplog
) -> None:
    gw = await make_gateway({UPSTREAM: ExplodingTransport()})
    await gw.register("r1")
    r = await gw.chat("r1", MESSAGES)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert message.startswith("internal gateway error (id ")
    assert "secret" not in r.text and "RuntimeError" not in r.text
    assert r.headers["connection"] == "close"
    assert "secret internal state" in caplog.text  # the operator's log has it
    metrics = (await gw.client.get("/metrics")).text
    assert "rollout_gateway_internal_errors_total 1" in metrics


async def test_upstream_credentials_never_leave_the_gateway(make_gateway) -> None:
    secret_url = "http://user:hunter2@upstream-a/v1"

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    gw = await make_gateway({secret_url: httpx.MockTransport(refuse)})
    await gw.register("r1")
    r = await gw.chat("r1", MESSAGES)
    assert r.status_code == 502 and "hunter2" not in r.text and "upstream-a" not in r.text
    health = await gw.client.get("/health")
    assert "hunter2" not in health.text and health.json()["upstreams"][0]["url"] == (
        "http://upstream-a/v1"
    )
    assert "hunter2" not in (await gw.client.get("/metrics")).text
    anonymous = await gw.client.get("/health", headers={"Authorization": ""})
    assert "upstreams" not in anonymous.json()  # only the admin sees upstream details
    assert (await gw.client.get("/metrics", headers={"Authorization": ""})).status_code == 401


def logprob_upstream(values: list[str]) -> Starlette:
    """An upstream whose logprobs are raw JSON number tokens (NaN, -Infinity, 1e39...)."""

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        completion = build_completion(body, "m")
        ids = completion["choices"][0]["token_ids"][: len(values)]
        completion["choices"][0]["token_ids"] = ids
        completion["choices"][0]["logprobs"] = {"content": ["@LP@"] * len(ids)}
        text = json.dumps(completion)
        entries = ", ".join(f'{{"token": "t", "logprob": {v}}}' for v in values[: len(ids)])
        return Response(text.replace(", ".join(['"@LP@"'] * len(ids)), entries))

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_nonfinite_logprobs_are_served_as_null_and_flagged(make_gateway) -> None:
    gw = await make_gateway(logprob_upstream(["-0.5", "NaN", "-Infinity", "-1e39"]))
    await gw.register("r1")
    long_answer = [{"role": "user", "content": script({"say": "a long enough answer here"})}]
    assert (await gw.chat("r1", long_answer)).status_code == 200
    for _ in range(2):  # fetchable, every time
        r = await gw.trajectory("r1")
        assert r.status_code == 200, r.text
    step = r.json()["trajectory"][0]
    assert step["tokens"]["completion_logprobs"] == [-0.5, None, None, None]
    assert step["extras"]["nonfinite_logprobs"] == 3


def malformed_upstream() -> Starlette:
    async def chat(request: Request) -> Response:
        return Response(json.dumps({"choices": [7], "id": "x"}), media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_malformed_answer_to_a_stream_is_a_502_before_it_starts(make_gateway) -> None:
    # The answer is read whole before the first event (the engine does not stream): its
    # fault keeps its status (issue 26; a relayed stream's: tests/server/engines/).
    gw = await make_gateway(malformed_upstream())
    await gw.register("r1")
    r = await gw.chat("r1", {"messages": MESSAGES, "stream": True})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"] == "upstream answer is malformed"


class DripTransport(httpx.AsyncBaseTransport):
    """An upstream that answers headers at once, then one byte every 50 ms for 10 s."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async def drip():
            for _ in range(200):
                await asyncio.sleep(0.05)
                yield b" "

        return httpx.Response(200, content=drip())


async def test_upstream_timeout_bounds_the_whole_request(make_gateway) -> None:
    gw = await make_gateway({UPSTREAM: DripTransport()}, upstream_timeout_s=0.3)
    await gw.register("r1")
    start = asyncio.get_running_loop().time()
    r = await gw.chat("r1", MESSAGES)
    assert r.status_code == 502 and "timed out" in r.json()["error"]["message"]
    assert asyncio.get_running_loop().time() - start < 5


@pytest.mark.parametrize(
    "count,is_retry",
    [(b"\xb2", False), (b"9" * 5000, True), (b"-1", False), (b"0x1", False), (b" 00 ", False)],
    ids=["superscript-two", "5000-digits", "negative", "hex", "zero"],
)
async def test_odd_retry_count_header_is_read_not_an_internal_error(
    gw: GatewayHarness, count: bytes, is_retry: bool
) -> None:
    await gw.register("r1")
    r = await gw.chat("r1", MESSAGES, headers={"x-stainless-retry-count": count})
    assert r.status_code == 200, r.text
    # A second identical request: a retry joins the first turn, anything else is new.
    r = await gw.chat("r1", MESSAGES, headers={"x-stainless-retry-count": count})
    assert r.status_code == 200, r.text
    assert (await gw.trajectory("r1")).json()["num_turns"] == (1 if is_retry else 2)
    assert "rollout_gateway_internal_errors_total 0" in (await gw.client.get("/metrics")).text


async def test_health_names_upstreams_to_the_admin_only(make_gateway) -> None:
    gw = await make_gateway(RecordingUpstream(with_tokens=False).app())
    await gw.register("r1")
    assert (await gw.chat("r1", MESSAGES)).status_code == 200  # found: no token ids
    (warning,) = (await gw.client.get("/health")).json()["warnings"]
    assert warning.startswith("upstream http://upstream-a/v1: ") and "token ids" in warning
    for headers in ({"Authorization": ""}, gw.agent_headers("r1")):
        answer = await gw.client.get("/health", headers=headers)
        assert answer.json()["warnings"] == [warning.split(": ", 1)[1]]
        assert "upstream-a" not in answer.text


def engine_with_model_card(card: dict[str, object]) -> Starlette:
    async def models(request: Request) -> Response:
        return Response(json.dumps({"object": "list", "data": [card]}))

    app = RecordingUpstream().app()
    app.router.routes.insert(0, Route("/v1/models", models, methods=["GET"]))
    return app


async def test_model_cards_reach_agents_without_the_engines_paths(make_gateway) -> None:
    card = {
        "id": "Qwen/Qwen3-8B",
        "object": "model",
        "created": 1,
        "owned_by": "vllm",
        "root": "/srv/secret-models/qwen3-8b",
        "parent": "/srv/secret-models/base",
        "max_model_len": 40960,
        "permission": [{"id": "modelperm-1", "organization": "*"}],
    }
    gw = await make_gateway(engine_with_model_card(card))
    await gw.register("r1", model="Qwen/Qwen3-8B")
    for path in ("/v1/rollouts/r1/models", "/v1/models"):
        r = await gw.client.get(path, headers=gw.agent_headers("r1"))
        assert r.status_code == 200 and "secret-models" not in r.text, r.text
        assert r.json()["data"] == [
            {k: card[k] for k in ("id", "object", "created", "owned_by", "max_model_len")}
        ]


def nested(levels: int) -> str:
    """JSON text of ``levels`` lists around a string."""
    return "[" * levels + '"x"' + "]" * levels


@pytest.mark.parametrize(
    "template",
    [
        '{"messages": [{"role": "user", "content": %s}]}',
        '{"messages": [{"role": "user", "content": "hi", "name": %s}]}',
        '{"messages": [{"role": "user", "content": "hi"}], "stop": [[%s]]}',
        '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"a": %s}]}',
    ],
    ids=["content", "name", "stop", "tools"],
)
async def test_bodies_nested_deeper_than_the_gateway_can_write_back_are_400(
    gw: GatewayHarness, template: str
) -> None:
    # orjson reads 1024 levels but writes 254: a body between the two was a 500 (or a
    # trajectory nobody could fetch). 128 levels is the bound, with room to write.
    await gw.register("r1")
    headers = gw.agent_headers("r1", {"Content-Type": "application/json"})
    url = "/v1/rollouts/r1/chat/completions"
    for levels in (126, 300):  # the body is 129 levels deep (all four), and far deeper
        r = await gw.client.post(url, content=template % nested(levels), headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "request body nests deeper than 128 levels"
    r = await gw.client.post(url, content=template % nested(125), headers=headers)
    assert r.status_code == 200, r.text  # 128 levels: served, recorded and fetchable
    for query in ("", "?format=delta"):
        assert (await gw.client.get(f"/v1/rollouts/r1/trajectory{query}")).status_code == 200
    assert "rollout_gateway_internal_errors_total 0" in (await gw.client.get("/metrics")).text


async def test_register_refuses_sampling_params_nested_too_deep(gw: GatewayHarness) -> None:
    raw = '{"model": "m", "sampling_params": {"extra_body": ' + nested(200) + "}}"
    r = await gw.client.post("/v1/rollouts/r1/register", content=raw)
    assert r.status_code == 400 and "128 levels" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/v1/rollouts/r1/chat/completions/"),
        ("POST", "/v1/chat/completions/"),
        ("GET", "/v1/rollouts/r1/trajectory/"),
        ("POST", "/v1/rollouts/r1/cancel/"),
        ("GET", "/health/"),
        ("GET", "/metrics/"),
    ],
)
async def test_a_trailing_slash_is_a_json_404_not_a_redirect(
    gw: GatewayHarness, method: str, path: str
) -> None:
    await gw.register("r1")
    r = await gw.client.request(method, path, headers=gw.agent_headers("r1", {"Host": "evil"}))
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["type"] == "not_found"
    assert (await gw.trajectory("r1")).json()["status"] == "active"


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"stream": "false"}, "stream"),
        ({"logprobs": "false"}, "logprobs"),
        ({"return_token_ids": 0}, "return_token_ids"),
        ({"include_reasoning": "false"}, "include_reasoning"),
        ({"stream": True, "stream_options": "include_usage"}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "false"}}, "include_usage"),
    ],
)
async def test_answer_flags_that_are_not_booleans_are_400_not_guessed(
    gw: GatewayHarness, fields: dict[str, object], named: str
) -> None:
    # "false" is true to Python (and false to the engine): the agent would get a stream,
    # token ids or usage it did not ask for.
    await gw.register("r1")
    r = await gw.chat("r1", {"messages": MESSAGES, **fields})
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
    nulls = {"stream": None, "logprobs": None, "include_reasoning": None, "stream_options": None}
    r = await gw.chat("r1", {"messages": MESSAGES, **nulls})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert (await gw.trajectory("r1")).json()["num_turns"] == 1


def engine_answering(status: int, body: str, media_type: str) -> Starlette:
    async def chat(request: Request) -> Response:
        return Response(body, status_code=status, media_type=media_type)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize(
    "status,body,media_type,agent_sees",
    [
        (
            400,
            "<html><body>Bad Request. Apache/2.4.41 Server at 10.1.2.3 Port 8000</body></html>",
            "text/html",
            "upstream error 400",
        ),
        (404, "Not found at /srv/engine/app.py", "text/plain", "upstream error 404"),
        (
            422,
            json.dumps({"detail": [{"loc": ["body", "n"], "msg": "Input should be > 0"}]}),
            "application/json",
            "Input should be > 0",
        ),
        (
            400,
            json.dumps({"error": {"message": "'max_tokens' must be at least 1", "code": 400}}),
            "application/json",
            "'max_tokens' must be at least 1",
        ),
    ],
    ids=["proxy-html", "plain-text", "fastapi-detail", "engine-json"],
)
async def test_only_an_engines_json_error_message_reaches_the_agent(
    make_gateway, caplog, status: int, body: str, media_type: str, agent_sees: str
) -> None:
    gw = await make_gateway(engine_answering(status, body, media_type))
    await gw.register("r1")
    r = await gw.chat("r1", MESSAGES)
    assert r.status_code in (400, 404) and r.json()["error"]["message"] == agent_sees
    for internal in ("10.1.2.3", "/srv/engine"):
        assert internal not in r.text
        assert internal in caplog.text or internal not in body  # the operator's log has it
