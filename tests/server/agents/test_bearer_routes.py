"""Bearer-key routing (issue 9, gateway side): the per-rollout key finds the rollout."""

from __future__ import annotations

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..conftest import GatewayHarness, RecordingUpstream, script


def keyed_sdk(gw: GatewayHarness, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key=api_key,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(gw.app)),
        max_retries=0,
    )


async def test_chat_routed_by_key_reaches_only_its_rollout(gw: GatewayHarness) -> None:
    await gw.register("r1")
    await gw.register("r2")
    messages = [{"role": "user", "content": script({"say": "keyed"})}]
    answer = await keyed_sdk(gw, gw.keys["r2"]).chat.completions.create(
        model="x", messages=messages
    )
    assert answer.choices[0].message.content == "keyed"
    stream = await keyed_sdk(gw, gw.keys["r2"]).chat.completions.create(
        model="x", messages=[*messages, {"role": "user", "content": "more"}], stream=True
    )
    assert [c async for c in stream]
    assert (await gw.trajectory("r1")).json()["num_turns"] == 0
    assert (await gw.trajectory("r2")).json()["num_turns"] == 2
    with pytest.raises(openai.AuthenticationError):
        await keyed_sdk(gw, "not-a-key").chat.completions.create(model="x", messages=messages)
    # The path-based route stays.
    assert (await gw.chat("r1", messages)).status_code == 200


async def test_unregistered_key_is_401(gw: GatewayHarness) -> None:
    await gw.register("r1")
    key = gw.keys["r1"]
    await gw.client.post("/v1/rollouts/r1/unregister")
    r = await gw.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 401


def vllm_like_models() -> Starlette:
    upstream = RecordingUpstream()

    async def models(request: Request) -> Response:
        card = {"id": "Qwen/Qwen3-8B", "object": "model", "max_model_len": 40960}
        return JSONResponse({"object": "list", "data": [card]})

    app = upstream.app()
    app.router.routes.insert(0, Route("/v1/models", models, methods=["GET"]))
    return app


async def test_models_by_key_lists_the_upstream_with_its_max_model_len(make_gateway) -> None:
    gw = await make_gateway(vllm_like_models())
    await gw.register("r1", model="Qwen/Qwen3-8B")
    listing = await keyed_sdk(gw, gw.keys["r1"]).models.list()
    assert [(m.id, m.max_model_len) for m in listing.data] == [("Qwen/Qwen3-8B", 40960)]
    await gw.register("r2", model="policy-alias")
    listing = await keyed_sdk(gw, gw.keys["r2"]).models.list()
    assert [(m.id, m.max_model_len) for m in listing.data][0] == ("policy-alias", 40960)
    with pytest.raises(openai.AuthenticationError):
        await keyed_sdk(gw, "nope").models.list()
