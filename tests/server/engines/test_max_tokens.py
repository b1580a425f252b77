"""The completion bound a turn sends upstream, and the engines' context refusals (issue 30).

Never more than the engine can give, never less than was asked within the rollout's
limits; a refused ``max_tokens`` is not a context overflow: the turn asks again with the
room the engine states, and the rollout goes on.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_gateway.scripted import build_completion, create_scripted_model_app
from rollout_gateway.server.engines.context_refusal import (
    COMPLETION,
    PROMPT,
    read_context_refusal,
    retry_max_tokens,
)
from rollout_gateway.server.engines.upstream_request import max_tokens_to_send

from ..conftest import GatewayFactory, GatewayHarness, script
from .fake_engines import FakeSGLang
from .test_true_streaming import ReplayVLLM, sdk

HI = [{"role": "user", "content": script({"say": "hi"})}]
WINDOW = 4096


# ---------------------------------------------------------------- what is sent


@pytest.mark.parametrize(
    "asked,budget,window,sent",
    [
        (None, None, None, None),  # nobody set anything: nothing is sent
        (None, None, WINDOW, None),
        (None, 4_000, WINDOW, 4_000),  # the rollout's budget, smaller than the context
        (None, 9_000, WINDOW, None),  # the context binds first: the engine's own default
        (None, 500, None, 500),  # a budget, context unknown: the budget
        (32_000, None, WINDOW, WINDOW),  # never more than the engine can give
        (32_000, None, None, 32_000),  # the context unknown: as asked
        (100, None, WINDOW, 100),  # never less than asked
        (100, 40, WINDOW, 40),  # within the rollout's limits
        (32_000, 5_000, WINDOW, WINDOW),
    ],
)
def test_the_max_tokens_sent(
    asked: int | None, budget: int | None, window: int | None, sent: int | None
) -> None:
    assert max_tokens_to_send(asked, budget, window) == sent


# ---------------------------------------------------------------- the engines' refusals

#: (message, kind, window, prompt tokens): vLLM 0.32's wordings as the real server sent
#: them (tests/real_engine), older vLLMs' and SGLang's as their sources write them.
REFUSALS = [
    (
        "max_tokens=4000000 cannot be greater than max_model_len=4096. Please request fewer "
        "output tokens. (parameter=max_tokens, value=4000000)",
        COMPLETION, 4096, None,
    ),
    (
        "max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request "
        "fewer output tokens. (parameter=max_completion_tokens, value=5000)",
        COMPLETION, 4096, None,
    ),
    (
        "This model's maximum context length is 4096 tokens. However, your prompt contains at "
        "least 4097 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=4097)",
        PROMPT, 4096, 4097,
    ),
    ("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", PROMPT, None, None),
    (
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
        "context length is 4096 tokens and your request has 2778 input tokens "
        "(8000 > 4096 - 2778). None",
        COMPLETION, 4096, 2778,
    ),
    (
        "This model's maximum context length is 4096 tokens. However, your request has 5000 "
        "input tokens. Please reduce the length of the input messages.",
        PROMPT, 4096, 5000,
    ),
    (
        "This model's maximum context length is 4096 tokens. However, you requested 1000 "
        "output tokens and your prompt contains 3500 input tokens, for a total of 4500 tokens.",
        COMPLETION, 4096, 3500,
    ),
    (
        "This model's maximum context length is 4096 tokens. However, you requested 4297 "
        "tokens (4097 in the messages, 200 in the completion). Please reduce the length of "
        "the messages or completion.",
        PROMPT, 4096, 4097,
    ),
    (
        "This model's maximum context length is 4096 tokens. However, you requested 4297 "
        "tokens (3000 in the messages, 1297 in the completion). Please reduce the length of "
        "the messages or completion.",
        COMPLETION, 4096, 3000,
    ),
    ("Input length (5000) exceeds model's maximum context length (4096).", PROMPT, 4096, 5000),
    (
        "Requested token count exceeds the model's maximum context length of 262144 tokens. "
        "You requested a total of 267042 tokens: 201506 tokens from the input messages and "
        "65536 tokens for the completion. Please reduce the number of tokens in the input "
        "messages or the completion to fit within the limit.",
        COMPLETION, 262144, 201506,
    ),
    (
        "Requested token count exceeds the model's maximum context length of 4096 tokens. "
        "You requested a total of 4200 tokens: 4100 tokens from the input messages and 100 "
        "tokens for the completion.",
        PROMPT, 4096, 4100,
    ),
    (
        "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
        PROMPT, 4096, 5000,
    ),
    (
        "Input length (5000 tokens) exceeds the maximum allowed length (4096 tokens). Use a "
        "shorter input or enable --allow-auto-truncate.",
        PROMPT, 4096, 5000,
    ),
    ("the prompt exceeds the context window of this model", PROMPT, None, None),
]  # fmt: skip


@pytest.mark.parametrize("message,kind,window,prompt", REFUSALS)
def test_each_engine_wording_is_told_apart(
    message: str, kind: str, window: int | None, prompt: int | None
) -> None:
    refusal = read_context_refusal(message)
    assert refusal is not None
    assert (refusal.kind, refusal.window, refusal.prompt_tokens) == (kind, window, prompt)


def test_other_400s_are_not_context_refusals() -> None:
    for message in ("'temperature' must be a number", "top_logprobs must be at most 20"):
        assert read_context_refusal(message) is None


def test_the_retry_asks_for_the_room_the_engine_states() -> None:
    sglang = read_context_refusal(REFUSALS[10][0])
    assert sglang is not None and retry_max_tokens(sglang, sent=65536) == 262144 - 201506
    vllm = read_context_refusal(REFUSALS[0][0])  # the window, not the prompt
    assert vllm is not None and retry_max_tokens(vllm, sent=4_000_000) == 4096
    # Nothing smaller to ask: the refusal goes to the agent.
    assert retry_max_tokens(sglang, sent=262144 - 201506) is None
    prompt = read_context_refusal(REFUSALS[2][0])
    assert prompt is not None and retry_max_tokens(prompt, sent=100) is None


# ---------------------------------------------------------------- through the gateway


def _replaying(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that hands ``body`` (already read) once, then the real one."""
    handed = False

    async def replay() -> dict[str, Any]:
        nonlocal handed
        if handed:
            return await receive()
        handed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def recording_scripted(**fields: Any) -> tuple[Starlette, list[dict[str, Any]]]:
    """The scripted model (checking its context as ``fields`` say), recording requests."""
    app = create_scripted_model_app(**fields)
    bodies: list[dict[str, Any]] = []

    async def record(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            chunks = []
            while True:
                message = await receive()
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            body = b"".join(chunks)
            bodies.append(json.loads(body))
            await app(scope, _replaying(body, receive), send)
            return
        await app(scope, receive, send)

    return record, bodies  # type: ignore[return-value]


async def test_an_agent_that_sets_nothing_gets_an_answer_and_a_normal_rollout(
    make_gateway: GatewayFactory,
) -> None:
    """The issue's reproduction, on the scripted model that checks what vLLM checks."""
    app, bodies = recording_scripted(max_model_len=WINDOW)
    gw = await make_gateway(app)
    await gw.register("r1", max_turns=5)
    r = await gw.chat("r1", HI)
    assert r.status_code == 200, r.text
    assert "max_tokens" not in bodies[-1]
    traj = (await gw.trajectory("r1")).json()
    assert traj["status"] == "active" and not traj["is_truncated"]
    extras = traj["trajectory"][0]["extras"]
    assert "max_tokens" not in extras["sampling"] and extras["agent_sampling"] == {}


async def test_an_agent_asking_more_than_the_context_gets_the_context(
    make_gateway: GatewayFactory,
) -> None:
    app, bodies = recording_scripted(max_model_len=WINDOW)
    gw = await make_gateway(app)
    await gw.register("r1")
    r = await gw.chat("r1", {"messages": HI, "max_tokens": 32_000, "temperature": 0.3})
    assert r.status_code == 200, r.text
    assert bodies[-1]["max_tokens"] == WINDOW
    extras = (await gw.trajectory("r1")).json()["trajectory"][0]["extras"]
    assert extras["agent_sampling"] == {"max_tokens": 32_000, "temperature": 0.3}  # as sent
    assert extras["sampling"]["max_tokens"] == WINDOW  # and what went upstream


async def test_the_gateways_default_budget_is_never_sent(make_gateway: GatewayFactory) -> None:
    """A context the gateway does not know (no model card): nothing is sent but what
    someone set."""
    app, bodies = recording_scripted(max_model_len=None)
    gw = await make_gateway(app)
    await gw.register("r1")
    assert (await gw.chat("r1", HI)).status_code == 200
    assert "max_tokens" not in bodies[-1]
    await gw.register("r2", max_total_completion_tokens=50)
    assert (await gw.chat("r2", HI)).status_code == 200
    assert bodies[-1]["max_tokens"] == 50  # the rollout's own budget


async def test_a_prompt_filling_the_context_ends_the_rollout(
    make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM answers "max_tokens must be at least 1, got 0" to a prompt of exactly its
    context: the prompt's fault. The log names the turn by its own number."""
    prompt_len = len(build_completion({"messages": HI, "return_token_ids": True}, "m")[
        "prompt_token_ids"
    ])  # fmt: skip
    gw = await make_gateway(create_scripted_model_app(max_model_len=prompt_len))
    await gw.register("r1")
    with caplog.at_level(logging.INFO, logger="rollout_gateway.server"):
        r = await gw.chat("r1", HI)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    traj = (await gw.trajectory("r1")).json()
    assert traj["truncation_reason"] == "context_length_exceeded" and traj["num_turns"] == 1
    turns = {m.split("turn=")[1].split()[0].rstrip(":") for m in caplog.messages if "turn=" in m}
    assert turns == {"1"}


async def test_sglang_refuses_a_completion_that_does_not_fit_and_the_turn_asks_again(
    make_gateway: GatewayFactory,
) -> None:
    """SGLang checks prompt + max_tokens: the first call is refused, the turn asks again
    with the room SGLang states, once; one step is recorded and the rollout goes on."""
    engine = FakeSGLang(max_model_len=WINDOW)
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="m")
    r = await gw.chat("r1", {"messages": HI, "max_tokens": 32_000})
    assert r.status_code == 200, r.text
    first, second = (b.get("max_tokens") for b in engine.requests)
    assert first == WINDOW and second is not None and second < WINDOW
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 1 and traj["status"] == "active" and not traj["is_truncated"]
    extras = traj["trajectory"][0]["extras"]
    assert extras["sampling"]["max_tokens"] == second
    assert extras["max_tokens_refused"]["max_tokens"] == WINDOW
    assert "Requested token count exceeds" in extras["max_tokens_refused"]["message"]
    assert not traj.get("failed_turns")
    # Nothing asked: nothing sent, SGLang gives what its context leaves.
    assert (await gw.chat("r1", {"messages": HI})).status_code == 200
    assert "max_tokens" not in engine.requests[-1]


async def test_sglang_prompt_overflow_still_ends_the_rollout(make_gateway: GatewayFactory) -> None:
    engine = FakeSGLang(max_model_len=50)
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="m")
    r = await gw.chat("r1", HI)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(engine.requests) == 1  # not asked again: the prompt itself does not fit
    traj = (await gw.trajectory("r1")).json()
    assert traj["truncation_reason"] == "context_length_exceeded"


class StubbornEngine:
    """An engine that refuses every ``max_tokens`` as too large for a 50-token prompt in
    a 100-token context (vLLM 0.8's wording), whatever is asked."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.requests.append(body)
            if body.get("max_tokens") is not None:
                message = (
                    f"'max_tokens' or 'max_completion_tokens' is too large: "
                    f"{body['max_tokens']}. This model's maximum context length is 100 tokens "
                    f"and your request has 50 input tokens ({body['max_tokens']} > 100 - 50)."
                )
                return JSONResponse(
                    {"object": "error", "message": message, "type": "BadRequestError"},
                    status_code=400,
                )
            return JSONResponse(build_completion({**body}, "m"))

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": []})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )


async def test_a_refusal_the_retry_cannot_mend_goes_to_the_agent_and_the_rollout_goes_on(
    make_gateway: GatewayFactory,
) -> None:
    engine = StubbornEngine()
    gw = await make_gateway(engine.app())
    await gw.register("r1", model="m")
    r = await gw.chat("r1", {"messages": HI, "max_tokens": 80})
    assert r.status_code == 400, r.text
    assert "is too large" in r.json()["error"]["message"]
    assert [b["max_tokens"] for b in engine.requests] == [80, 50]  # asked again once, then no
    traj = (await gw.trajectory("r1")).json()
    assert traj["status"] == "active" and not traj["is_truncated"] and traj["num_turns"] == 0
    assert [f["error"]["status_code"] for f in traj["failed_turns"]] == [400]
    assert (await gw.chat("r1", HI)).status_code == 200  # the next turn is served


class VLLMWithoutCard(ReplayVLLM):
    """A vLLM whose model card says no context (the gateway learns it from a refusal)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        inner = super().app()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"].endswith("/models"):
                await JSONResponse({"object": "list", "data": [{"owned_by": "vllm"}]})(
                    scope, receive, send
                )
                return
            if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
                body = json.loads((await receive())["body"])
                asked = body.get("max_tokens")
                if asked is not None and asked > WINDOW:
                    self.bodies.append(body)
                    message = (
                        f"max_tokens={asked} cannot be greater than max_model_len={WINDOW}. "
                        f"Please request fewer output tokens. (parameter=max_tokens, "
                        f"value={asked})"
                    )
                    error = {"message": message, "type": "BadRequestError", "code": 400}
                    await JSONResponse({"error": error}, status_code=400)(scope, receive, send)
                    return
                await inner(scope, _replaying(json.dumps(body).encode(), receive), send)
                return
            await inner(scope, receive, send)

        self._app = app

    def app(self) -> Any:  # type: ignore[override]
        return self._app


async def test_a_streamed_turn_asks_again_and_the_gateway_learns_the_context(
    make_gateway: GatewayFactory,
) -> None:
    engine = VLLMWithoutCard("text")
    gw: GatewayHarness = await make_gateway(engine.app())
    await gw.register("r1", model="gemma3-270m")
    client = sdk(gw, "r1")
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="agent", messages=engine.request["messages"], stream=True, max_tokens=9000
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text
    # Turn 1: refused, asked again with the context the refusal states; turn 2 sends it.
    assert [b.get("max_tokens") for b in engine.bodies] == [9000, WINDOW, WINDOW]
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    assert "max_tokens_refused" in steps[0]["extras"]
    assert "max_tokens_refused" not in steps[1]["extras"]


@pytest.mark.parametrize("value", [0, -1, "10", True, 1.5])
async def test_a_bad_max_tokens_is_a_400_before_the_engine(
    make_gateway: GatewayFactory, value: Any
) -> None:
    app, bodies = recording_scripted()
    gw = await make_gateway(app)
    await gw.register("r1")
    for key in ("max_tokens", "max_completion_tokens"):
        r = await gw.chat("r1", {"messages": HI, key: value})
        assert r.status_code == 400 and key in r.json()["error"]["message"]
    r = await gw.register("r2", sampling_params={"max_tokens": value})
    assert r.status_code == 400 and "sampling_params.max_tokens" in r.json()["error"]["message"]
    assert bodies == []
