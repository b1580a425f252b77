"""The Responses dialect's fast paths make exactly what its general code makes.

The usual turn (new items that are plain text messages, a plain answer, a message
streamed) takes shortcuts: one loop over the new items (``_plain_messages``), the usual
usage counts read at once, a message item's stream events from templates. Each is
checked here against the general code on the same input, including inputs that must fall
back to it.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import orjson
import pytest

from rollout_gateway.server.dialects import responses_parse, responses_render
from rollout_gateway.server.dialects.completion import completion_chunks, first_choice, usage_counts
from rollout_gateway.server.dialects.responses_parse import ResponsesContext
from rollout_gateway.server.dialects.responses_stream import ResponsesStream


def message(role: str | None, text: Any, kind: str = "input_text", **extra: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "message", "content": [{"type": kind, "text": text}]}
    if role is not None:
        item["role"] = role
    return {**item, **extra}


def answer(text: str, **extra: Any) -> dict[str, Any]:
    return message("assistant", text, "output_text", status="completed", **extra)


#: Items the fast loop takes, and items it must leave to the general code.
PLAIN = [
    message("user", "Go on."),
    message("developer", "Be brief."),
    message("system", "Rules."),
    answer("Step 1: done."),
    answer(""),  # no text: the message's content is None
    message("user", 'é \u2028 "quoted" \\ \n', "output_text"),
]
FALLBACK = [
    answer("state", encrypted_content="abc"),
    answer("phase", phase="final_answer"),
    message(None, "no role"),  # an assistant-side item without a role
    message("tool", "odd role"),
    message("user", 7),  # not a string
    message("user", "x", "refusal"),
    {"type": "message", "role": "user", "content": "a string"},
    {"type": "message", "role": "user", "content": []},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}] * 2},
    {"type": "message", "role": "user", "content": ["not an object"]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
    {"type": "additional_tools", "tools": [{"type": "function", "name": "g"}]},
]


def general(items: list[dict[str, Any]], start: int) -> tuple[Any, ...]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "head"}]
    ends: list[int | None] = [1] * start
    dropped: dict[int, list[str]] = {}
    declared: list[tuple[int, Any]] = []
    responses_parse._translate(items, start, out, ends, dropped, declared)
    return out, ends, dropped, declared


def test_the_fast_loop_makes_what_the_general_code_makes() -> None:
    rng = random.Random(31)
    taken = fell_back = 0
    for _ in range(3000):
        pool = PLAIN if rng.random() < 0.6 else PLAIN + FALLBACK
        items = [copy.deepcopy(rng.choice(pool)) for _ in range(rng.randint(1, 6))]
        start = rng.randint(0, len(items))
        out: list[dict[str, Any]] = [{"role": "system", "content": "head"}]
        ends: list[int | None] = [1] * start
        if responses_parse._plain_messages(items, start, out, ends):
            taken += 1
            assert (out, ends, {}, []) == general(items, start)
            assert orjson.dumps(out) == orjson.dumps(general(items, start)[0])
        else:  # left as it was, for the general code
            fell_back += 1
            assert (out, ends) == ([{"role": "system", "content": "head"}], [1] * start)
    assert taken > 500 and fell_back > 500


def test_two_answers_in_a_row_fold_as_one_run() -> None:
    items = [message("user", "hi"), answer("a"), answer("b"), message("user", "go")]
    out: list[dict[str, Any]] = []
    ends: list[int | None] = []
    assert not responses_parse._plain_messages(items, 0, out, ends)
    assert out == [] and ends == []
    folded = general(items, 0)[0]
    assert folded[2] == {"role": "assistant", "content": "ab"}


def test_a_whole_parse_is_the_same_with_and_without_the_memo() -> None:
    """Turn by turn with the memo (the fast loop on the new items, the previous
    messages' text extended) and afresh (the fast loop from the first item, or the
    general code where it falls back; the messages written whole)."""
    items: list[dict[str, Any]] = [message("developer", "sys " * 50)]
    memo = None
    for turn in range(6):
        items = [*items, message("user", f"turn {turn}")]
        if turn == 3:
            items.append({"type": "function_call_output", "call_id": "c", "output": "x"})
        if turn == 4:  # a rewritten history: part of the memo's text only, written anew
            items[1] = message("user", "turn 0, rewritten")
        body = {"model": "m", "input": items, "store": False}
        parsed = responses_parse.parse_responses_request(copy.deepcopy(body), memo)
        fresh = responses_parse.parse_responses_request(copy.deepcopy(body))
        assert parsed.messages_text == fresh.messages_text
        assert parsed.body == fresh.body and parsed.facts == fresh.facts
        memo = parsed.memo
        items = [*items, answer(f"answer {turn}")]


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
        {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": None},
        {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
        },  # fmt: skip
        {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "completion_tokens_details": {"reasoning_tokens": 2},
        },  # fmt: skip
        {"prompt_tokens": -1, "completion_tokens": 3},
        {"prompt_tokens": True, "completion_tokens": 3},
        {"prompt_tokens": 1.5, "completion_tokens": 3},
        {},
    ],
)
def test_usage_read_at_once_is_the_general_reading(usage: dict[str, Any]) -> None:
    counts = usage_counts(usage)
    assert responses_render.usage_of(usage) == {
        "input_tokens": counts.prompt,
        "input_tokens_details": {"cached_tokens": counts.cached or 0},
        "output_tokens": counts.completion,
        "output_tokens_details": {"reasoning_tokens": counts.reasoning or 0},
        "total_tokens": counts.prompt + counts.completion,
    }


def completion(content: str, **message: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-Ab_1",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **message},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }


def reference_events(stream: ResponsesStream, answer: dict[str, Any]) -> bytes:
    """The stream of ``answer`` with every event written by the general framing."""
    out = []
    for chunk in completion_chunks(answer):
        out.append(stream.feed(chunk))
    out.append(stream.finish(answer))
    return b"".join(out)


def parse_events(data: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    events = []
    for block in data.split(b"\n\n"):
        if block:
            name, payload = block.split(b"\n", 1)
            events.append((name, orjson.loads(payload.removeprefix(b"data: "))))
    return events


@pytest.mark.parametrize(
    "answer",
    [
        completion("Hello \u2028 \"world\" é"),
        completion("", reasoning="think", tool_calls=[
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
        completion("text then call", reasoning_content="why", tool_calls=[
            {"id": "c", "type": "custom", "custom": {"name": "g", "input": "x"}}]),
    ],
)  # fmt: skip
def test_message_events_from_templates_are_the_framed_events(answer: dict[str, Any]) -> None:
    """Every event's bytes are ``orjson`` of its object, fields in the order the general
    framing writes them (type, sequence number, then the payload), numbered in order."""
    data = reference_events(ResponsesStream(ResponsesContext()), answer)
    events = parse_events(data)
    for number, (name, payload) in enumerate(events):
        assert name == b"event: " + payload["type"].encode()
        assert payload["sequence_number"] == number
        framed = b"event: %b\ndata: %b\n\n" % (payload["type"].encode(), orjson.dumps(payload))
        assert framed in data
    assert (
        b"".join(
            b"event: %b\ndata: %b\n\n" % (p["type"].encode(), orjson.dumps(p)) for _, p in events
        )
        == data
    )
    head = ["type", "sequence_number"]
    where = [*head, "item_id", "output_index", "content_index"]
    for _, payload in events:  # the message's events: their fields in the general order
        if payload.get("item", {}).get("type") == "message" or "part" in payload:
            order = {
                "response.output_item.added": [*head, "output_index", "item"],
                "response.output_item.done": [*head, "output_index", "item"],
                "response.content_part.added": [*where, "part"],
                "response.content_part.done": [*where, "part"],
            }[payload["type"]]
            assert list(payload) == order
            assert list(payload.get("item", {"id": 0, "type": 0, "status": 0, "role": 0,
                                             "content": 0})) == [
                "id", "type", "status", "role", "content"]  # fmt: skip
        if payload["type"] == "response.output_text.done":
            assert list(payload) == [*where, "text", "logprobs"]
    final = events[-1][1]["response"]
    assert final == responses_render.render_response(answer, ResponsesContext())
    if answer["choices"][0]["message"]["content"]:
        done = [p for _, p in events if p["type"] == "response.output_item.done"]
        message_done = next(p["item"] for p in done if p["item"]["type"] == "message")
        assert message_done in final["output"]


def test_the_final_answer_is_the_same_whatever_base_it_is_given() -> None:
    answer = completion("hi")
    context = ResponsesContext()
    assert responses_render.render_response(answer, context, "Ab_1") == (
        responses_render.render_response(answer, context)
    )
    other = {**answer, "id": "chatcmpl-other"}  # a completion whose id is not the chunks'
    stream = ResponsesStream(context)
    for chunk in completion_chunks(answer):
        stream.feed(chunk)
    closing = parse_events(stream.finish(other))
    assert closing[-1][1]["response"]["id"] == "resp_other"


def _first_choice_by_loop(completion: dict[str, Any]) -> Any:
    """Choice 0 as the general loop finds it (what ``first_choice``'s one-choice read
    must equal)."""
    for choice in completion.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


@pytest.mark.parametrize(
    "choices",
    [
        [{"index": 0, "message": {"content": "a"}}],
        [{"message": {"content": "no index"}}],
        [{"index": 1, "message": {"content": "not choice 0"}}],
        [{"index": 1}, {"index": 0, "message": {"content": "second"}}],
        [{"index": 0, "message": {"content": "first"}}, {"index": 0}],
        ["not an object"],
        [],
        None,
        ({"index": 0},),  # a tuple: the loop's
    ],
)
def test_the_one_choice_read_finds_what_the_loop_finds(choices: Any) -> None:
    completion = {"id": "chatcmpl-1", "choices": choices}
    assert first_choice(completion) == _first_choice_by_loop(completion)
    if choices and isinstance(choices[0], dict) and choices[0].get("index", 0) == 0:
        assert first_choice(completion) is choices[0]
