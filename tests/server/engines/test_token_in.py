"""Token-in upstream mode: the gateway renders and bridges turns with ``renderers`` and
calls a vLLM-shaped ``/inference/v1/generate``.

The fake engine answers in vLLM 0.32's token mode shape, taken from its source
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``: ``GenerateTokensResponse``,
``GenerateLogProbsContent`` = ``{token_id, logprob, rank, top_logprobs}``) and checked
against a real answer of the shared real-vLLM recipe; its 403 without
``--enable-scale-out`` is ``scale_out/factories.py``'s. The tokenizer is a byte-level
one built here (one token per byte, Gemma-style turn tokens) with a Gemma-style template,
so nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("renderers", reason="token-in mode needs the [tito] extra (renderers)")
pytest.importorskip("transformers", reason="token-in mode needs the [tito] extra (transformers)")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from rollout_gateway.server import GatewayConfig, create_app  # noqa: E402
from rollout_gateway.server.engines.token_in import (  # noqa: E402
    TokenInUnavailable,
    is_bridgeable_tail,
    read_generate_logprobs,
)
from rollout_gateway.server.engines.upstream import UpstreamError  # noqa: E402

from ..conftest import ADMIN_TOKEN, UPSTREAM, GatewayFactory  # noqa: E402

RENDERER = "rollout_gateway.server.template_bridge:end_of_turn_pythonic"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
# Gemma's turn format; tool calls as a Python call list; tool results in a user turn.
TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{{ '<start_of_turn>user\\n[tool result ' ~ m['tool_call_id'] ~ ']\\n' ~ m['content']"
    " ~ '<end_of_turn>\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{ '<start_of_turn>model\\n' ~ (m['content'] or '') }}"
    "{%- if m['tool_calls'] -%}[{%- for tc in m['tool_calls'] -%}"
    "{{ tc['function']['name'] ~ '(' }}"
    "{%- for k, v in tc['function']['arguments'].items() -%}{{ k ~ '=' ~ (v | tojson) }}"
    "{%- endfor -%})"
    "{%- endfor -%}]{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- else -%}"
    "{{ '<start_of_turn>user\\n' }}"
    "{%- if loop.first and tools -%}{{ 'Tools: ' ~ (tools | map(attribute='function')"
    " | map(attribute='name') | join(',')) ~ '\\n' }}{%- endif -%}"
    "{{ m['content'] ~ '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
SYSTEM = {"role": "user", "content": "You are a shell agent."}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level tokenizer with Gemma's turn tokens, saved as an HF model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    fast.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return path


class FakeTokenEngine:
    """vLLM 0.32 with ``--enable-scale-out`` (or without: ``scale_out=False``)."""

    def __init__(
        self,
        tokenizer_dir: Path,
        answers: list[str],
        *,
        scale_out: bool = True,
        breaks: list[Callable[[str], str]] | None = None,
        routing: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.close = self.tok.convert_tokens_to_ids("<end_of_turn>")
        self.answers = list(answers)
        self.scale_out = scale_out
        #: Applied, one per answer, to the answer's JSON text (a malformed engine).
        self.breaks = list(breaks or [])
        #: ``enable_return_routed_experts``: ``"object"`` (prime-rl's server), ``"npy"``
        #: (vLLM's own serving), or ``None`` (off).
        self.routing = routing
        self.routed: list[Any] = []
        self.max_model_len = 4096
        self.requests: list[dict[str, Any]] = []
        self.sent: list[tuple[list[int], list[float]]] = []

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            if not self.scale_out:
                message = (
                    "Scale-out endpoints are disabled. Restart vllm serve with "
                    "--enable-scale-out to enable them."
                )
                error = {"message": message, "type": "PermissionDeniedError", "code": 403}
                return JSONResponse({"error": error}, status_code=403)
            body = json.loads(await request.body())
            if not body.get("token_ids"):  # vLLM validates the request first (min_length=1)
                error = {"message": "token_ids: field required", "type": "BadRequestError"}
                return JSONResponse({"error": {**error, "code": 400}}, status_code=400)
            self.requests.append(body)
            ids = [*self.tok.encode(self.answers.pop(0), add_special_tokens=False), self.close]
            logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
            self.sent.append((ids, logprobs))
            n = len(body["token_ids"])
            choice_extra: dict[str, Any] = {}
            if self.routing is not None:
                start = body["sampling_params"].get("routed_experts_prompt_start", 0)
                choice_extra["routed_experts"] = self.routed_experts(
                    [*body["token_ids"], *ids], start
                )
            answer = JSONResponse(
                {
                    "request_id": f"generate-tokens-{len(self.requests)}",
                    "model": body["model"],
                    "created": 1795457921,
                    "usage": {
                        "prompt_tokens": n,
                        "total_tokens": n + len(ids),
                        "completion_tokens": len(ids),
                    },
                    "prompt_token_ids": None,
                    "output_mode": "tokens",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "stop_reason": self.close,
                            "token_ids": ids,
                            "logprobs": {
                                "content": [
                                    {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                                    for t, lp in zip(ids, logprobs, strict=True)
                                ]
                            },
                            **choice_extra,
                        }
                    ],
                }
            )
            if self.breaks:
                text = self.breaks.pop(0)(bytes(answer.body).decode())
                return Response(text, media_type="application/json")
            return answer

        async def models(request: Request) -> Response:
            card = {"id": "m", "owned_by": "vllm", "max_model_len": self.max_model_len}
            return JSONResponse({"object": "list", "data": [card]})

        return Starlette(
            routes=[
                Route("/inference/v1/generate", generate, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
            ]
        )

    def routed_experts(self, sequence: list[int], start: int) -> Any:
        """The expert ids of positions ``start ..`` of ``sequence`` (2 layers, top-2: the
        token id and the position, mod 256), the last one excluded (no forward pass ran on
        the last sampled token), encoded as the engine does."""
        import base64
        import io

        import numpy as np

        rows = [[[t % 256, p % 256]] * 2 for p, t in enumerate(sequence)][start:-1]
        array = np.array(rows, dtype=np.uint8).reshape(len(rows), 2, 2)
        self.routed.append(array)
        if self.routing == "npy":  # vllm/entrypoints/scale_out/token_in_token_out/serving.py
            buffer = io.BytesIO()
            np.save(buffer, array.astype(np.int32))
            return base64.b64encode(buffer.getvalue()).decode()
        # prime_rl/inference/vllm/routed_experts.py: serialize_routed_experts
        data = base64.b64encode(array.tobytes()).decode("ascii")
        return {"data": data, "shape": list(array.shape), "start": start, "dtype": "uint8"}


async def token_in_gateway(
    make_gateway: GatewayFactory, engine: FakeTokenEngine, tokenizer_dir: Path
) -> Any:
    return await make_gateway(
        engine.app(), upstream_mode="token-in", tokenizer=str(tokenizer_dir), renderer=RENDERER
    )


def _extends(prev: dict[str, Any], step: dict[str, Any]) -> bool:
    before = prev["tokens"]["prompt_ids"] + prev["tokens"]["completion_ids"]
    return step["tokens"]["prompt_ids"][: len(before)] == before


async def test_tool_rollout_bridges_each_turn_onto_the_sampled_ids(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(
        tokenizer_dir, ['[run_shell(command="ls -a")]', "Two files.", "Done: a.txt, b.txt"]
    )
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    assert "warnings" not in (await gw.client.get("/health")).json()  # the probe found it
    reg = await gw.register("r1", sampling_params={"temperature": 0.7, "max_tokens": 64, "seed": 7})
    assert reg.status_code == 200, reg.text
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
    answers = []
    for turn in range(3):
        # The agent's own sampling fields are dropped (allowlist), the registered ones sent.
        body = {"model": "x", "messages": messages, "tools": TOOLS, "temperature": 2.0}
        r = await gw.chat("r1", body)
        assert r.status_code == 200, r.text
        answer = r.json()
        answers.append(answer)
        message = answer["choices"][0]["message"]
        if turn == 0:  # parsed by the renderer's tool parser
            assert answer["choices"][0]["finish_reason"] == "tool_calls"
            call = message["tool_calls"][0]
            assert call["function"]["name"] == "run_shell"
            assert json.loads(call["function"]["arguments"]) == {"command": "ls -a"}
            assert call["id"].startswith("call_")
            messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "a b"}]
        else:
            assert answer["choices"][0]["finish_reason"] == "stop"
            assert "tool_calls" not in message
            messages += [message, {"role": "user", "content": f"Go on ({turn})."}]
        # Token fields only when the agent asks for them.
        assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]
    assert answers[1]["choices"][0]["message"]["content"] == "Two files."

    steps = (await gw.trajectory("r1")).json()["trajectory"]
    assert len(steps) == 3
    for step, sent, (ids, logprobs) in zip(steps, engine.requests, engine.sent, strict=True):
        # Recorded: the ids the gateway sent, and what the engine sampled.
        assert step["tokens"]["prompt_ids"] == sent["token_ids"]
        assert step["tokens"]["completion_ids"] == ids
        assert step["tokens"]["completion_logprobs"] == pytest.approx(logprobs)
        params = sent["sampling_params"]
        assert params["temperature"] == 0.7 and params["max_tokens"] == 64
        assert params["logprobs"] == 1 and engine.close in params["stop_token_ids"]
        assert step["extras"]["sampling"]["temperature"] == 0.7
        assert step["extras"]["dropped_fields"] == ["temperature"]
    # Distinct per-turn seeds derived from the registered one, as in chat mode.
    assert len({s["sampling_params"]["seed"] for s in engine.requests}) == 3
    assert [s["extras"]["bridged"] for s in steps] == [False, True, True]
    assert [s["extras"].get("prefix_break") for s in steps[1:]] == [False, False]
    assert all(_extends(a, b) for a, b in zip(steps, steps[1:], strict=False))


async def test_edited_history_is_rendered_from_scratch_and_flagged(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ["Hello there.", "Fine.", "Ok."])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi."}]
    assert (await gw.chat("r1", messages)).status_code == 200
    # The agent rewrites the model's answer before going on: not a bridge.
    messages += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}]
    assert (await gw.chat("r1", messages)).status_code == 200
    # Back to extending the model's own answer: bridged again.
    messages += [
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "Again."},
    ]
    r = await gw.chat("r1", messages)
    assert r.status_code == 200
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    assert [s["extras"]["bridged"] for s in steps] == [False, False, True]
    assert steps[1]["extras"]["prefix_break"] is True and not _extends(steps[0], steps[1])
    assert steps[2]["extras"]["prefix_break"] is False and _extends(steps[1], steps[2])


async def test_streamed_answer_is_built_from_the_whole_answer(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ['[run_shell(command="pwd")]'])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1")
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": "Where am I?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await gw.chat("r1", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    calls = [
        tc
        for c in chunks
        for choice in c["choices"]
        for tc in (choice.get("delta") or {}).get("tool_calls") or []
    ]
    assert calls and calls[0]["function"]["name"] == "run_shell"
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "pwd"}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == len(engine.sent[0][0])
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    assert steps[0]["tokens"]["completion_ids"] == engine.sent[0][0]
    assert steps[0]["extras"]["not_applied"] == ["tool_choice"]


async def test_engine_without_scale_out_fails_the_turn_clearly(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, [], scale_out=False)
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    # Found at start-up: /health says so.
    (warning,) = (await gw.client.get("/health")).json()["warnings"]
    assert "--enable-scale-out" in warning
    await gw.register("r1")
    r = await gw.chat("r1", [{"role": "user", "content": "Hi."}])
    assert r.status_code == 502
    assert "--enable-scale-out" in r.json()["error"]["message"]
    traj = (await gw.trajectory("r1")).json()
    assert traj["trajectory"] == [] and traj["num_turns"] == 0
    assert traj["failed_turns"][0]["error"]["status_code"] == 502
    # The rollout is still usable once the engine serves the endpoint.
    engine.scale_out, engine.answers = True, ["Hi."]
    assert (await gw.chat("r1", [{"role": "user", "content": "Hi."}])).status_code == 200
    assert "warnings" not in (await gw.client.get("/health")).json()


async def test_prompt_longer_than_the_engine_context_ends_the_rollout(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, [])
    engine.max_model_len = 40
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1")
    r = await gw.chat("r1", [{"role": "user", "content": "x" * 100}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    traj = (await gw.trajectory("r1")).json()
    assert traj["truncation_reason"] == "context_length_exceeded"
    assert engine.requests == []  # refused before the engine was asked


async def test_registered_n_above_one_is_refused(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ["x"])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1", sampling_params={"n": 2})
    r = await gw.chat("r1", [{"role": "user", "content": "Hi."}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_in_token_in_mode"
    assert engine.requests == []


def test_missing_renderers_is_a_startup_error_naming_the_option(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "renderers", None)  # as if not installed
    config = GatewayConfig.from_fields(
        upstreams=[UPSTREAM],
        admin_token=ADMIN_TOKEN,
        upstream_mode="token-in",
        tokenizer=str(tokenizer_dir),
    )
    with pytest.raises(TokenInUnavailable, match=r"--upstream-mode token-in.*\[tito\]"):
        create_app(config)


def test_unloadable_tokenizer_and_bad_renderer_name_the_option(tmp_path: Path) -> None:
    config = GatewayConfig.from_fields(
        upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN, upstream_mode="token-in",
        tokenizer=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(TokenInUnavailable, match="--tokenizer"):
        create_app(config)


def test_bad_renderer_names_the_option(tokenizer_dir: Path) -> None:
    config = GatewayConfig.from_fields(
        upstreams=[UPSTREAM], admin_token=ADMIN_TOKEN, upstream_mode="token-in",
        tokenizer=str(tokenizer_dir), renderer="no.such.module:factory",
    )  # fmt: skip
    with pytest.raises(TokenInUnavailable, match="--renderer"):
        create_app(config)


def test_bridgeable_tails() -> None:
    assert is_bridgeable_tail([{"role": "tool"}, {"role": "tool"}])
    assert is_bridgeable_tail([{"role": "tool"}, {"role": "user"}])
    assert is_bridgeable_tail([{"role": "user"}])
    assert not is_bridgeable_tail([])
    assert not is_bridgeable_tail([{"role": "user"}, {"role": "tool"}])
    assert not is_bridgeable_tail([{"role": "system"}, {"role": "user"}])
    assert not is_bridgeable_tail([{"role": "assistant"}, {"role": "user"}])


def test_generate_logprobs_in_both_shapes_and_mismatch() -> None:
    vllm_032 = {"logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]}}
    older = {"logprobs": {"content": [{"token": "token_id:5", "logprob": -0.5}]}}
    assert read_generate_logprobs(vllm_032, [5]) == [-0.5]
    assert read_generate_logprobs(older, [5]) == [-0.5]
    with pytest.raises(UpstreamError):
        read_generate_logprobs(vllm_032, [6])
    with pytest.raises(UpstreamError):
        read_generate_logprobs(vllm_032, [5, 6])


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"type": "function"}]},
        {"tools": "run_shell"},
        {"tool_calls": "run_shell(command='ls')"},
        {"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{"}}]},
    ],
    ids=["tool-without-function", "tools-not-a-list", "tool-calls-not-a-list", "bad-arguments"],
)
async def test_messages_the_template_cannot_render_are_400_not_500(
    make_gateway: GatewayFactory, tokenizer_dir: Path, body: dict[str, Any]
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ["ok"])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1")
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
    if "tool_calls" in body:
        call = {"role": "assistant", "content": None, "tool_calls": body.pop("tool_calls")}
        messages += [call, {"role": "tool", "tool_call_id": "c1", "content": "a b"}]
    r = await gw.chat("r1", {"messages": messages, **body})
    assert r.status_code == 400, r.text
    assert "cannot render" in r.json()["error"]["message"]
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 0 and traj["failed_turns"][0]["error"]["status_code"] == 400
    assert "rollout_gateway_internal_errors_total 0" in (await gw.client.get("/metrics")).text
    assert engine.requests == []  # nothing reached the engine


def _replace(old: str, new: str) -> Callable[[str], str]:
    def change(text: str) -> str:
        assert old in text, text
        return text.replace(old, new, 1)

    return change


def _edit(change: Callable[[dict[str, Any]], Any]) -> Callable[[str], str]:
    def apply(text: str) -> str:
        data = json.loads(text)
        change(data)
        return json.dumps(data)

    return apply


BIG = "9" * 401


@pytest.mark.parametrize(
    "breaks",
    [
        _replace('"logprob":', f'"logprob":{BIG},"x":'),
        _replace('"created":', f'"created":{BIG},"x":'),
        _replace('"token_ids":[', '"token_ids":["²",'),
        _replace('"token_ids":[', f'"token_ids":[{BIG},'),
        _replace('"token_ids":[', '"token_ids":[99999999,'),
        _replace('"logprobs":{', '"logprobs":[1],"x":{'),
        _edit(lambda d: d["choices"][0]["logprobs"]["content"][0].update(
            token_id=None, token="token_id:" + "9" * 5000
        )),
        _edit(lambda d: d.update(created="yesterday")),
        _edit(lambda d: d["choices"][0].update(finish_reason=["stop"])),
        _edit(lambda d: d.update(choices=["x"])),
        _edit(lambda d: d.update(usage={"prompt_tokens": 1e300, "total_tokens": None})),
        _replace('"finish_reason":"stop"', '"finish_reason":"\\ud800"'),
    ],
    ids=[
        "huge-logprob", "huge-created", "id-a-string", "huge-id", "id-beyond-vocabulary",
        "logprobs-a-list", "5000-digit-token-name", "created-a-word", "finish-a-list",
        "choice-a-string", "odd-usage", "lone-surrogate",
    ],
)  # fmt: skip
async def test_a_malformed_generate_answer_is_a_502_not_a_500(
    make_gateway: GatewayFactory, tokenizer_dir: Path, breaks: Callable[[str], str]
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ["bad", "good"], breaks=[breaks])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    await gw.register("r1")
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
    r = await gw.chat("r1", {"messages": messages})
    assert r.status_code in (200, 502), r.text
    assert "rollout_gateway_internal_errors_total 0" in (await gw.client.get("/metrics")).text
    again = await gw.chat("r1", {"messages": [*messages, {"role": "user", "content": "again"}]})
    assert again.status_code == 200, again.text
    assert (await gw.trajectory("r1")).status_code == 200


async def tool_rollout(gw: Any, rollout_id: str, turns: int = 3) -> list[dict[str, Any]]:
    """``turns`` turns whose requests extend each other (bridged), the agents' answers."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
    answers = []
    for turn in range(turns):
        r = await gw.chat(rollout_id, {"model": "x", "messages": messages, "tools": TOOLS})
        assert r.status_code == 200, r.text
        answer = r.json()
        answers.append(answer)
        message = answer["choices"][0]["message"]
        messages += [message, {"role": "user", "content": f"Go on ({turn})."}]
    return answers


@pytest.mark.parametrize("encoding", ["object", "npy"])
async def test_routed_experts_are_recorded_per_turn_aligned_to_its_tokens(
    make_gateway: GatewayFactory, tokenizer_dir: Path, encoding: str
) -> None:
    import base64

    import numpy as np

    engine = FakeTokenEngine(tokenizer_dir, ["One.", "Two.", "Three."], routing=encoding)
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    assert (await gw.register("r1")).status_code == 200
    answers = await tool_rollout(gw, "r1")
    # The agent never gets the routing (megabytes per turn on a real model).
    assert all("routed_experts" not in a["choices"][0] for a in answers)

    traj = (await gw.trajectory("r1")).json()
    steps = traj["trajectory"]
    held = 0
    for step, request, sent in zip(steps, engine.requests, engine.routed, strict=True):
        tokens = step["tokens"]
        routed = tokens["routed_experts"]
        # A bridged turn asks from the previous turn's last position (no forward pass ran
        # on it), as verifiers v1's TrainClient does; the first turn from 0.
        start = request["sampling_params"].get("routed_experts_prompt_start", 0)
        assert start == max(held - 1, 0)
        assert (routed["start"], routed["shape"], routed["dtype"]) == (
            start,
            [*sent.shape],
            "uint8",
        )
        rows = np.frombuffer(base64.b64decode(routed["data"]), dtype=np.uint8).reshape(sent.shape)
        sequence = tokens["prompt_ids"] + tokens["completion_ids"]
        assert len(rows) == len(sequence) - start - 1
        assert [int(r[0][0]) for r in rows] == [t % 256 for t in sequence[start:-1]]
        held = len(sequence)
    # The delta form (what the env adapters fetch) carries it too.
    delta = (await gw.client.get(
        "/v1/rollouts/r1/trajectory",
        params={"format": "delta"},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )).json()  # fmt: skip
    assert [s["tokens"]["routed_experts"] for s in delta["trajectory"]] == [
        s["tokens"]["routed_experts"] for s in steps
    ]


async def test_without_routed_experts_the_steps_carry_none(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    engine = FakeTokenEngine(tokenizer_dir, ["One.", "Two."])
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    assert (await gw.register("r1")).status_code == 200
    await tool_rollout(gw, "r1", turns=2)
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    assert all("routed_experts" not in s["tokens"] for s in steps)


async def test_the_v1_branch_carries_the_routing_the_trainer_replays(
    make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    # What prime-rl reads (Branch.routed_experts -> TrainingSample.routed_experts): the
    # gateway's record replayed into a v1 trace is one branch whose routing has a row per
    # token, each the routing of its own position.
    pytest.importorskip("rollout_gateway.v1", reason="the v1 adapter needs verifiers 0.4")
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.task import TaskData
    from verifiers.v1.trace import AgentInfo, TraceTask

    from rollout_gateway.v1.trace_sync import TraceSync

    engine = FakeTokenEngine(tokenizer_dir, ["One.", "Two.", "Three."], routing="object")
    gw = await token_in_gateway(make_gateway, engine, tokenizer_dir)
    assert (await gw.register("r1")).status_code == 200
    await tool_rollout(gw, "r1")
    answer = (await gw.client.get(
        "/v1/rollouts/r1/trajectory",
        params={"format": "delta"},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )).json()  # fmt: skip
    trace = vf.Trace(
        task=TraceTask(type="T", data=TaskData(prompt="x")),
        agent=AgentInfo(config=AgentConfig(model="m")),
    )
    TraceSync(trace, model="m", sampling=None, rollout_id="r1").apply(answer)
    (branch,) = trace.branches
    experts = branch.routed_experts
    assert experts is not None and experts.shape == (len(branch.token_ids), 2, 2)
    # Every position's row is its own token's (the last: v1's placeholder, a copy).
    assert [int(r[0][1]) for r in experts[:-1]] == list(range(len(branch.token_ids) - 1))
    assert [int(r[0][0]) for r in experts[:-1]] == [t % 256 for t in branch.token_ids[:-1]]
