"""``TemplateBridgeRenderer``: bridges keep the sampled ids and add what the template adds;
``PythonicToolParser``: call lists become tool calls, anything else stays text."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("renderers", reason="token-in mode needs the [tito] extra (renderers)")
pytest.importorskip("transformers", reason="token-in mode needs the [tito] extra (transformers)")

from renderers.base import ToolCallParseStatus, load_tokenizer  # noqa: E402

from rollout_gateway.server.template_bridge import (  # noqa: E402
    TemplateBridgeRenderer,
    end_of_turn_pythonic,
)

from .test_token_in import TOOLS, tokenizer_dir  # noqa: E402, F401  (the fixture)


@pytest.fixture(scope="module")
def renderer(tokenizer_dir: Path) -> TemplateBridgeRenderer:  # noqa: F811
    return end_of_turn_pythonic(load_tokenizer(str(tokenizer_dir)))


def encode(renderer: TemplateBridgeRenderer, text: str) -> list[int]:
    return renderer._tokenizer.encode(text, add_special_tokens=False)


def test_bridge_equals_a_full_render_when_the_answer_ended_its_turn(
    renderer: TemplateBridgeRenderer,
) -> None:
    history = [{"role": "user", "content": "Hi."}]
    prompt = renderer.render(history, tools=TOOLS, add_generation_prompt=True).token_ids
    answer = [*encode(renderer, "Hello."), renderer.close_id]
    tail = [{"role": "user", "content": "More."}]
    bridged = renderer.bridge_to_next_turn(prompt, answer, tail, tools=TOOLS)
    assert bridged is not None
    assert bridged.token_ids[: len(prompt) + len(answer)] == prompt + answer
    full = renderer.render(
        [*history, {"role": "assistant", "content": "Hello."}, *tail],
        tools=TOOLS,
        add_generation_prompt=True,
    ).token_ids
    assert bridged.token_ids == full


def test_cut_answer_is_closed_and_kept_as_sampled(renderer: TemplateBridgeRenderer) -> None:
    prompt = renderer.render(
        [{"role": "user", "content": "Hi."}], add_generation_prompt=True
    ).token_ids
    cut = encode(renderer, "Hello, I am")  # max_tokens hit: no close token
    bridged = renderer.bridge_to_next_turn(prompt, cut, [{"role": "user", "content": "Go."}])
    assert bridged is not None
    ids = bridged.token_ids
    assert ids[: len(prompt) + len(cut)] == prompt + cut
    assert ids[len(prompt) + len(cut)] == renderer.close_id


def test_assistant_or_empty_tail_is_not_bridged(renderer: TemplateBridgeRenderer) -> None:
    prompt = renderer.render([{"role": "user", "content": "Hi."}], add_generation_prompt=True)
    answer = [*encode(renderer, "Hello."), renderer.close_id]
    assert renderer.bridge_to_next_turn(prompt.token_ids, answer, []) is None
    tail = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert renderer.bridge_to_next_turn(prompt.token_ids, answer, tail) is None


def test_stop_ids_hold_eos_and_the_turn_close(renderer: TemplateBridgeRenderer) -> None:
    stops = renderer.get_stop_token_ids()
    assert renderer.close_id in stops and renderer._tokenizer.eos_token_id in stops


@pytest.mark.parametrize(
    "text,expected",
    [
        ('[run_shell(command="ls")]', [("run_shell", {"command": "ls"}, "ok")]),
        ("[a(x=1), b(y=[1, 2])]", [("a", {"x": 1}, "ok"), ("b", {"y": [1, 2]}, "ok")]),
        ("[run_shell(cmd)]", [("run_shell", None, ToolCallParseStatus.INVALID_JSON)]),
        ("[1, 2, 3]", []),
        ("I would run [ls] now.", []),
        ('[run_shell(command="ls")] and more text', []),
    ],
)
def test_pythonic_calls(renderer: TemplateBridgeRenderer, text: str, expected: list) -> None:
    ids = [*encode(renderer, text), renderer.close_id]
    parsed = renderer.parse_response(ids, tools=TOOLS)
    got = [(tc.name, tc.arguments, tc.status) for tc in parsed.tool_calls]
    assert got == expected
    assert (parsed.content == "") == bool(expected)


def test_unknown_close_token_is_refused(tokenizer_dir: Path) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="close token"):
        TemplateBridgeRenderer(load_tokenizer(str(tokenizer_dir)), "<|im_end|>")
