"""A whole answer's usual case written from a template is the general rendering's JSON.

Both dialects write the usual answer (one message of text, finished, the engine's usual
``usage``) at once (``render_response_json``, ``render_message_json``, and the final
``response.completed`` event of a Responses stream); every other answer is rendered as
a whole and dumped. Each answer here, usual or not, must give exactly ``orjson.dumps``
of the general rendering, or the same ``TypeError``.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import orjson
import pytest

from rollout_gateway.server.dialects import anthropic_render, responses_render
from rollout_gateway.server.dialects.completion import _ID_UNSAFE, completion_chunks, id_base
from rollout_gateway.server.dialects.responses_parse import ResponsesContext
from rollout_gateway.server.dialects.responses_stream import ResponsesStream

USUAL: dict[str, Any] = {
    "id": "chatcmpl-0123456789abcdef",
    "object": "chat.completion",
    "created": 1764400000,
    "model": "scripted",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Step 1: a.txt and b.txt."},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 1040, "completion_tokens": 14, "total_tokens": 1054},
}

#: One change each to the usual answer: (where, key, value); ``where`` is the completion,
#: its choice 0 or its message. ``...`` removes the key.
CHANGES: list[tuple[str, str, Any]] = [
    ("message", "content", 'é \u2028 "quoted" \\ \n </script>'),
    ("message", "content", ""),
    ("message", "content", None),
    ("message", "content", [{"type": "text", "text": "parts"}]),
    ("message", "content", 7),
    ("message", "reasoning_content", None),
    ("message", "reasoning_content", "why"),
    ("message", "reasoning", ""),
    ("message", "reasoning", "think"),
    ("message", "tool_calls", []),
    ("message", "tool_calls", None),
    ("message", "tool_calls", [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]),
    ("message", "tool_calls", ["not an object"]),
    ("choice", "finish_reason", "length"),
    ("choice", "finish_reason", "content_filter"),
    ("choice", "finish_reason", "tool_calls"),
    ("choice", "finish_reason", None),
    ("choice", "stop_reason", "</done>"),
    ("choice", "stop_reason", 151645),
    ("choice", "index", 1),
    ("choice", "message", "not an object"),
    ("completion", "choices", []),
    ("completion", "choices", [{"index": 0, "message": {"content": "a"}}, {"index": 1}]),
    ("completion", "id", "chatcmpl-Ab_1-x"),
    ("completion", "id", "chatcmpl-a/b c"),
    ("completion", "id", ""),
    ("completion", "id", 5),
    ("completion", "id", "x" * 200),
    ("completion", "id", "chatcmpl-\u00e9\u00e9"),
    ("completion", "created", True),
    ("completion", "created", 1.5),
    ("completion", "created", -5),
    ("completion", "created", 2**64),
    ("completion", "created", ...),
    ("completion", "model", None),
    ("completion", "model", 'm\u2028"x"'),
    ("completion", "model", 12),
    ("completion", "usage", None),
    ("completion", "usage", {"prompt_tokens": 3, "completion_tokens": 2}),
    ("completion", "usage", {"prompt_tokens": 10, "completion_tokens": 3,
                             "prompt_tokens_details": {"cached_tokens": 4}}),
    ("completion", "usage", {"prompt_tokens": 10, "completion_tokens": 3,
                             "completion_tokens_details": {"reasoning_tokens": 2}}),
    ("completion", "usage", {"prompt_tokens": -1, "completion_tokens": 3}),
    ("completion", "usage", {"prompt_tokens": True, "completion_tokens": 3}),
    ("completion", "usage", {"prompt_tokens": 2**64, "completion_tokens": 3}),
    ("completion", "usage", {"prompt_tokens": 2**63, "completion_tokens": 2**63}),
]  # fmt: skip

CONTEXTS = [
    ResponsesContext(),
    ResponsesContext(tool_choice="required", parallel_tool_calls=False),
    ResponsesContext(tool_choice={"type": "function", "name": "f"}),
]


def changed(changes: tuple[tuple[str, str, Any], ...]) -> dict[str, Any]:
    """The usual answer with ``changes`` made (to copies)."""
    completion = {**USUAL, "choices": [{**USUAL["choices"][0]}]}
    choice = completion["choices"][0]
    choice["message"] = {**choice["message"]}
    for where, key, value in changes:
        target = {"completion": completion, "choice": choice, "message": choice["message"]}
        place = target[where]
        if not isinstance(place, dict):
            continue  # the change before replaced it
        if value is ...:
            place.pop(key, None)
        else:
            place[key] = value
    return completion


def outcome(write: Any, *args: Any) -> bytes | str:
    """What ``write(*args)`` gives: its bytes, or the ``TypeError`` it raises."""
    try:
        return bytes(write(*args))
    except TypeError as exc:
        return f"TypeError: {exc}"


def dumped(render: Any) -> Any:
    return lambda *args: orjson.dumps(render(*args))


def check_both(completion: dict[str, Any]) -> None:
    for context in CONTEXTS:
        expected = outcome(dumped(responses_render.render_response), completion, context)
        got = outcome(responses_render.render_response_json, completion, context)
        assert got == expected, completion
    for show in (True, False):
        expected = outcome(dumped(anthropic_render.render_message), completion, show)
        got = outcome(anthropic_render.render_message_json, completion, show)
        assert got == expected, completion


def test_the_usual_answer_takes_the_template() -> None:
    assert responses_render.usual_answer(USUAL) is not None
    assert anthropic_render.usual_answer(USUAL) is not None
    check_both(USUAL)


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: f"{c[0]}.{c[1]}={c[2]!r}"[:60])
def test_one_change_renders_as_the_general_code(change: tuple[str, str, Any]) -> None:
    check_both(changed((change,)))


def test_changes_together_render_as_the_general_code() -> None:
    for pair in itertools.combinations(CHANGES, 2):
        check_both(changed(pair))
    rng = random.Random(31)
    for _ in range(300):
        check_both(changed(tuple(rng.sample(CHANGES, rng.randint(3, 6)))))


def test_the_templates_are_taken_only_for_the_usual_answer() -> None:
    """The fallbacks are the general code, not a template with the wrong fields."""
    cut = changed((("choice", "finish_reason", "length"),))
    assert responses_render.usual_answer(cut) is None
    assert anthropic_render.usual_answer(cut) is None
    calls = changed(CHANGES[11:12])
    assert responses_render.usual_answer(calls) is None
    assert anthropic_render.usual_answer(calls) is None


@pytest.mark.parametrize(
    "completion_id",
    ["chatcmpl-abc123", "chatcmpl-", "chatcmpl-Ab_1-x", "a b/c", "", None, 5, "é1", "x" * 300,
     "chatcmpl-\u0661\u0662", "chatcmpl-ABC\u00b2"],
)  # fmt: skip
def test_the_ids_base_is_the_general_cleaning(completion_id: Any) -> None:
    text = completion_id if isinstance(completion_id, str) and completion_id else "gateway"
    cleaned = _ID_UNSAFE.sub("", text.removeprefix("chatcmpl-"))[:96] or "gateway"
    assert id_base(completion_id) == cleaned


def streamed(completion: dict[str, Any], context: ResponsesContext) -> tuple[bytes, int]:
    """The Responses stream of ``completion`` (its chunks fed, then finished): the
    finish's bytes and how many items its chunks opened."""
    stream = ResponsesStream(context)
    for chunk in completion_chunks(completion):
        stream.feed(chunk)
    items = stream.items
    return stream.finish(completion), items


@pytest.mark.parametrize("change", [None, *CHANGES], ids=lambda c: repr(c)[:60])
def test_a_streams_final_answer_is_the_general_rendering(change: Any) -> None:
    """A stream's closing events: the answer's items not streamed yet, then
    ``response.completed`` (or ``incomplete``) with the whole answer, as the general code
    frames them (the usual answer's from its template)."""
    completion = changed((change,) if change else ())
    for context in CONTEXTS:
        try:
            closing, items = streamed(completion, context)
        except TypeError:  # orjson refuses it: so does the general rendering
            with pytest.raises(TypeError):
                orjson.dumps(responses_render.render_response(completion, context))
            continue
        final = responses_render.render_response(completion, context)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        payload = {"type": kind, "sequence_number": 0, "response": final}
        last = closing[closing.rindex(b"event: response.") :]
        number = orjson.loads(last.split(b"data: ", 1)[1])["sequence_number"]
        payload["sequence_number"] = number
        assert last == b"event: %b\ndata: %b\n\n" % (kind.encode(), orjson.dumps(payload))
        added = closing.count(b"event: response.output_item.added\n")
        assert added == len(final["output"][items:])
