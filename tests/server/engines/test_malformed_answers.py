"""A malformed engine answer is the upstream's fault: a 502, never a 500 (issue 26).

Each case takes a well-formed answer of the scripted model and breaks it the way an
engine, a proxy or a bug could: integers JSON cannot carry back (a 401-digit logprob),
wrong types, missing fields, nesting too deep, lone surrogates. The agent gets a 502
(whole answer or stream), the gateway counts no internal error, and the rollout stays
usable: its trajectory is fetchable and its next turn runs. Token fields that do not read
as ids are kept out of the step instead (``tokens: null``), as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_gateway.scripted import build_completion

from ..conftest import GatewayHarness, script

BIG = "9" * 401
MESSAGES = [{"role": "user", "content": script({"say": "hello there"})}]


def good(body: dict[str, Any]) -> dict[str, Any]:
    return build_completion({**body, "return_token_ids": True, "logprobs": True}, "m")


def edit(change: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], str]:
    def answer(body: dict[str, Any]) -> str:
        completion = good(body)
        change(completion)
        return json.dumps(completion)

    return answer


def text_edit(old: str, new: str) -> Callable[[dict[str, Any]], str]:
    """Replace the first ``old`` of the answer's JSON text by ``new`` (for values json.dumps
    cannot write: huge integers as literals, NaN, lone surrogates, deep nesting)."""

    def answer(body: dict[str, Any]) -> str:
        text = json.dumps(good(body))
        assert old in text
        return text.replace(old, new, 1)

    return answer


def first_choice(change: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], str]:
    return edit(lambda c: change(c["choices"][0]))


def message(change: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], str]:
    return edit(lambda c: change(c["choices"][0]["message"]))


def deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


#: Answers that are a 502.
MALFORMED: dict[str, Callable[[dict[str, Any]], str]] = {
    "401-digit integer logprob": text_edit('"logprob": ', f'"logprob": {BIG}, "x": '),
    "401-digit integer token id": text_edit('"token_ids": [', f'"token_ids": [{BIG}, '),
    "401-digit integer usage": text_edit(
        '"completion_tokens": ', f'"completion_tokens": {BIG}, "x": '
    ),
    "401-digit integer choice index": text_edit('"index": 0', f'"index": {BIG}'),
    "401-digit integer created": text_edit('"created": ', f'"created": {BIG}, "x": '),
    "5000-digit integer": text_edit('"logprob": ', f'"logprob": {"9" * 5000}, "x": '),
    "lone surrogate in the content": text_edit('"content": "', '"content": "\\ud800'),
    "nesting too deep to write back": message(lambda m: m.update(extra=deep(250))),
    "nesting deeper than the parser reads": text_edit(
        '"object"', '"deep": ' + "[" * 5000 + "]" * 5000 + ', "object"'
    ),
    "not JSON": lambda body: "<html>bad gateway</html>",
    "empty": lambda body: "",
    "a list": lambda body: "[1, 2]",
    "a string": lambda body: '"chat.completion"',
    "choices an object": edit(lambda c: c.update(choices={"0": c["choices"][0]})),
    "no choices": edit(lambda c: c.update(choices=[])),
    "choices missing": edit(lambda c: c.pop("choices")),
    "a choice that is not an object": edit(lambda c: c.update(choices=["x"])),
    "a second choice that is not an object": edit(lambda c: c["choices"].append(7)),
    "message a list": first_choice(lambda c: c.update(message=[1])),
    "message missing": first_choice(lambda c: c.pop("message")),
    "content a number": message(lambda m: m.update(content=5)),
    "content an object": message(lambda m: m.update(content={"text": "x"})),
    "role a number": message(lambda m: m.update(role=5)),
    "tool_calls a string": message(lambda m: m.update(tool_calls="call")),
    "a tool call without function": message(lambda m: m.update(tool_calls=[{"id": "a"}])),
    "tool call arguments a number": message(
        lambda m: m.update(
            tool_calls=[{"id": "a", "type": "function", "function": {"name": "f", "arguments": 5}}]
        )
    ),
    "finish_reason a number": first_choice(lambda c: c.update(finish_reason=5)),
    "finish_reason a list": first_choice(lambda c: c.update(finish_reason=["stop"])),
    "SGLang meta logprob beyond a double": first_choice(
        lambda c: (
            c.pop("logprobs"),
            c.pop("token_ids"),
            c.update(meta_info={"output_token_logprobs": [[10**400, 1, "x"]]}),
        )
    ),
}

#: Answers whose token fields do not read: recorded with ``tokens: null``, answered 200.
UNREADABLE_TOKENS: dict[str, Callable[[dict[str, Any]], str]] = {
    "logprob a NaN string": first_choice(
        lambda c: [e.update(logprob="NaN") for e in c["logprobs"]["content"]]
    ),
    "logprob a word": first_choice(
        lambda c: [e.update(logprob="abc") for e in c["logprobs"]["content"]]
    ),
    "token ids a string": first_choice(lambda c: c.update(token_ids="abc")),
    "token ids floats": first_choice(lambda c: c.update(token_ids=[1.5] * len(c["token_ids"]))),
    "token ids lists": first_choice(lambda c: c.update(token_ids=[[1]] * len(c["token_ids"]))),
    "prompt ids beyond 32 bits": text_edit(
        '"prompt_token_ids": [', '"prompt_token_ids": [9999999999999, '
    ),
    "prompt ids objects": edit(lambda c: c.update(prompt_token_ids=[{}])),
    "logprobs a string": first_choice(lambda c: c.update(logprobs="x")),
    "usage a list": edit(lambda c: c.update(usage=[1])),
    "usage counts as text": edit(lambda c: c["usage"].update(completion_tokens="5")),
    "metadata a string": edit(lambda c: c.update(metadata="x")),
    "stop_reason an object": first_choice(lambda c: c.update(stop_reason={"a": 1})),
}


def faulty_engine(answers: list[Callable[[dict[str, Any]], str]]) -> Starlette:
    """An engine answering each chat request with the next of ``answers`` (then well)."""

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        make = answers.pop(0) if answers else (lambda b: json.dumps(good(b)))
        return Response(make(body), media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def _usable_after(gw: GatewayHarness, rollout_id: str) -> dict[str, Any]:
    """The rollout's trajectory, fetched, after a well-formed turn that must pass."""
    ok = await gw.chat(rollout_id, MESSAGES)
    assert ok.status_code == 200, ok.text
    trajectory = await gw.trajectory(rollout_id)
    assert trajectory.status_code == 200, trajectory.text
    assert gw.gateway.metrics.internal_errors.value() == 0
    return trajectory.json()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_answer_is_a_502_and_the_rollout_goes_on(
    make_gateway, case: str, stream: bool
) -> None:
    gw = await make_gateway(faulty_engine([MALFORMED[case]]))
    await gw.register("r1")
    body = {"messages": MESSAGES, "stream": stream, "logprobs": True, "return_token_ids": True}
    r = await gw.chat("r1", body)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "upstream_error"
    trajectory = await _usable_after(gw, "r1")
    # The failed call recorded no step; the well-formed turn after it did.
    assert trajectory["num_turns"] == 1
    assert trajectory["trajectory"][0]["tokens"] is not None


@pytest.mark.parametrize("case", list(UNREADABLE_TOKENS))
async def test_unreadable_token_fields_are_recorded_without_tokens(make_gateway, case: str) -> None:
    gw = await make_gateway(faulty_engine([UNREADABLE_TOKENS[case]]))
    await gw.register("r1")
    body = {"messages": MESSAGES, "logprobs": True, "return_token_ids": True}
    r = await gw.chat("r1", body)
    assert r.status_code == 200, r.text
    json.loads(r.text)  # what the agent gets is JSON
    trajectory = await _usable_after(gw, "r1")
    assert trajectory["num_turns"] == 2


def error_upstream(status: int, payload: str) -> Starlette:
    async def chat(request: Request) -> Response:
        return Response(payload, status_code=status, media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize("status", [400, 500])
async def test_an_engine_error_message_json_cannot_carry_is_not_a_500(
    make_gateway, status: int
) -> None:
    gw = await make_gateway(error_upstream(status, '{"error": {"message": "bad \\ud800 x"}}'))
    await gw.register("r1")
    r = await gw.chat("r1", MESSAGES)
    assert r.status_code in (400, 502), r.text
    assert gw.gateway.metrics.internal_errors.value() == 0


def vllm_streaming_engine(bad_chunk: str) -> Starlette:
    """A vLLM that streams (so the gateway relays its chunks) and sends ``bad_chunk``
    after a good first chunk."""

    async def chat(request: Request) -> Response:
        async def events():
            first = {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "prompt_token_ids": [1, 2, 3],
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": "hi"},
                        "token_ids": [104],
                        "logprobs": {"content": [{"token": "h", "logprob": -0.1}]},
                    }
                ],
            }
            yield f"data: {json.dumps(first)}\n\n"
            yield f"data: {bad_chunk}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        card = {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096}
        return JSONResponse({"object": "list", "data": [card]})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


@pytest.mark.parametrize(
    "bad_chunk",
    [
        '{"choices": [{"index": 0, "delta": {}, "token_ids": [' + BIG + "]}]}",
        '{"choices": [{"index": 0, "delta": {"content": "\\ud800"}}]}',
        '{"choices": [{"index": 0, "delta": {}, "finish_reason": ["stop"]}]}',
        '{"choices": [{"index": 0, "delta": {"content": 5}, "finish_reason": "stop"}]}',
        '{"choices": 5}',
        "[" * 5000 + "]" * 5000,
    ],
    ids=["huge int", "lone surrogate", "finish list", "content number", "choices number", "deep"],
)
async def test_a_malformed_chunk_of_a_relayed_stream_ends_it_with_an_error(
    make_gateway, bad_chunk: str
) -> None:
    gw = await make_gateway(vllm_streaming_engine(bad_chunk))
    await gw.register("r1")
    body = {"messages": MESSAGES, "stream": True}
    r = await gw.chat("r1", body)
    if r.status_code == 200:  # the stream had started: the error is its last event
        events = [line for line in r.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        assert "error" in json.loads(events[-2].removeprefix("data: "))
    else:
        assert r.status_code == 502, r.text
    assert gw.gateway.metrics.internal_errors.value() == 0
    trajectory = await gw.trajectory("r1")
    assert trajectory.status_code == 200 and trajectory.json()["num_turns"] == 0


def odd_models_engine(listing: str) -> Starlette:
    async def chat(request: Request) -> Response:
        return JSONResponse(good(json.loads(await request.body())))

    async def models(request: Request) -> Response:
        return Response(listing, media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


@pytest.mark.parametrize(
    "listing",
    [
        '{"data": [{"id": "m", "owned_by": "vllm", "max_model_len": ' + BIG + "}]}",
        '{"data": [{"id": "m\\ud800", "owned_by": "vllm"}]}',
        '{"data": 5}',
        "[" * 5000 + "]" * 5000,
    ],
    ids=["huge max_model_len", "lone surrogate", "data a number", "deep"],
)
async def test_odd_model_cards_never_break_health_or_the_model_list(
    make_gateway, listing: str
) -> None:
    gw = await make_gateway(odd_models_engine(listing))
    await gw.register("r1")
    assert (await gw.client.get("/health")).status_code == 200
    models = await gw.client.get("/v1/rollouts/r1/models", headers=gw.agent_headers("r1"))
    assert models.status_code == 200, models.text
    assert (await gw.chat("r1", MESSAGES)).status_code == 200
    assert gw.gateway.metrics.internal_errors.value() == 0


@pytest.mark.parametrize("asks_everything", [True, False], ids=["relayed-as-is", "rewritten"])
async def test_an_answer_nested_too_deep_outside_what_is_kept_is_never_a_500(
    make_gateway, asks_everything: bool
) -> None:
    # Read (orjson reads 1024 levels) and recorded (its message is shallow); relayed as the
    # engine's bytes when the agent asked for everything, else a 502 (orjson writes 254).
    gw = await make_gateway(faulty_engine([edit(lambda c: c.update(extra=deep(300)))]))
    await gw.register("r1")
    body: dict[str, Any] = {"messages": MESSAGES}
    if asks_everything:
        body.update(logprobs=True, return_token_ids=True)
    r = await gw.chat("r1", body)
    assert r.status_code == (200 if asks_everything else 502), r.text
    json.loads(r.text)
    trajectory = await _usable_after(gw, "r1")
    assert trajectory["num_turns"] == 2


async def test_the_deepest_answer_the_gateway_keeps_is_served_and_fetched(make_gateway) -> None:
    # A message 243 levels deep (content parts nested 242 lists deep) is kept: written
    # back in the answer, the trajectory and its delta form within orjson's 254 levels.
    gw = await make_gateway(faulty_engine([message(lambda m: m.update(content=deep(241)))]))
    await gw.register("r1")
    r = await gw.chat("r1", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    for params in ({}, {"format": "delta"}):
        trajectory = await gw.client.get("/v1/rollouts/r1/trajectory", params=params)
        assert trajectory.status_code == 200, trajectory.text
    assert gw.gateway.metrics.internal_errors.value() == 0
