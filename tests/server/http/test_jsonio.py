"""jsonio: the depth bound on request bodies, checked in C with reused wrapper chains, and
a chat body's messages written by that check."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from rollout_gateway.server.engines.upstream_request import build_upstream_request
from rollout_gateway.server.http.jsonio import (
    MAX_BODY_DEPTH,
    SPLICE_MIN_BYTES,
    SplicedText,
    TooDeepError,
    check_depth,
    dumps_request,
    dumps_request_pieces,
    loads_body,
    loads_chat_body,
    spliced_history,
    written_checked,
)


def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def _check_default_bound() -> None:
    check_depth(nested(MAX_BODY_DEPTH))
    with pytest.raises(TooDeepError, match=f"deeper than {MAX_BODY_DEPTH} levels"):
        check_depth(nested(MAX_BODY_DEPTH + 1))


def test_written_checked_is_orjsons_writing_and_the_same_bound() -> None:
    value = {"a": [1, {"b": "é\u0000"}], "c": nested(MAX_BODY_DEPTH - 1)}
    for _ in range(2):  # a reused wrapper chain writes the same
        assert written_checked(value) == orjson.dumps(value)
    assert written_checked(nested(MAX_BODY_DEPTH)) == orjson.dumps(nested(MAX_BODY_DEPTH))
    with pytest.raises(TooDeepError, match=f"deeper than {MAX_BODY_DEPTH} levels"):
        written_checked(nested(MAX_BODY_DEPTH + 1))
    assert written_checked(nested(10), max_depth=10) == orjson.dumps(nested(10))
    with pytest.raises(TooDeepError, match="deeper than 10 levels"):
        written_checked(nested(11), max_depth=10)
    assert written_checked({}) == b"{}" and written_checked([]) == b"[]"


def test_the_bound_is_exact_call_after_call_whatever_bound_came_before() -> None:
    for _ in range(3):  # the wrapper chain of one call is reused by the next
        _check_default_bound()
    check_depth(nested(10), max_depth=10)
    with pytest.raises(TooDeepError, match="deeper than 10 levels"):
        check_depth(nested(11), max_depth=10)
    with pytest.raises(TooDeepError):
        check_depth(nested(300), max_depth=200)
    _check_default_bound()  # a chain built for another bound is not reused for this one


CHAT_BODIES = [
    {"model": "m", "messages": [{"role": "user", "content": 'hi é \u2028 "q" \\ 😀'}]},
    {"messages": [], "stop": ["a", "b"], "tools": [{"type": "function", "function": {}}]},
    {"messages": [{"role": "tool", "content": [{"type": "text", "text": "x"}]}], "n": None},
    {"stream": True, "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
    {"messages": [{"role": "user", "content": "alone"}]},  # no other field
    {"tools": [{"function": {"parameters": {"a": [[{"b": "]"}]]}}}], "messages": [], "x": "["},
]


@pytest.mark.parametrize("body", CHAT_BODIES)
def test_a_chat_body_comes_with_its_messages_text_as_dumps_writes_it(body: Any) -> None:
    raw = json.dumps(body).encode()
    parsed = loads_chat_body(raw)
    assert parsed.value == body and list(parsed.value) == list(body)  # key order kept
    assert parsed.messages_text == orjson.dumps(body["messages"])


@pytest.mark.parametrize(
    "body",
    [
        *CHAT_BODIES,
        {"messages": [{"role": "user", "content": "nul \x00 and \x00"}], "stop": "\x00"},
        {"tools": [{"description": "\x00"}], "messages": [{"role": "user", "content": "a"}]},
    ],
)
def test_a_request_written_around_its_messages_view_is_the_one_written_with_a_fragment(
    body: Any,
) -> None:
    assert type(loads_chat_body(json.dumps(body).encode()).messages_text) is bytes  # short
    long = {"role": "user", "content": "p" * SPLICE_MIN_BYTES}
    body = {**body, "messages": [*body["messages"], long]}
    parsed = loads_chat_body(json.dumps(body).encode())
    view = parsed.messages_text
    assert isinstance(view, memoryview)  # the depth check's text, not a copy of it
    fragment = {**parsed.value, "messages": orjson.Fragment(bytes(view))}
    spliced = {**parsed.value, "messages": SplicedText(view)}
    assert dumps_request(spliced) == orjson.dumps(fragment)
    # The pieces a transport writes as they are: the same bytes, the view not copied.
    pieces = dumps_request_pieces(spliced)
    assert b"".join(pieces) == orjson.dumps(fragment) and pieces[1] is view
    assert type(spliced["messages"]) is SplicedText  # the body is left as it was
    assert orjson.loads(dumps_request(spliced)) == body
    # The upstream request built from the view is written as the one built from bytes.
    upstream = {"model": "m", "sampling_params": {"temperature": 0.5}, "max_tokens": 7}
    sent = [
        dumps_request(build_upstream_request(parsed.value, messages_text=text, **upstream))
        for text in (view, bytes(view))
    ]
    assert sent[0] == sent[1]


def test_a_request_without_a_spliced_text_is_dumps() -> None:
    body = {"model": "m", "messages": orjson.Fragment(b"[]"), "x": "\x00"}
    assert dumps_request(body) == orjson.dumps(body)
    assert dumps_request_pieces(body) == (orjson.dumps(body),)


@pytest.mark.parametrize("raw", [b"[1, 2]", b'{"model": "m"}', b'{"messages": {"a": 1}}'])
def test_other_bodies_are_parsed_without_messages_text(raw: bytes) -> None:
    parsed = loads_chat_body(raw)
    assert parsed.value == json.loads(raw) and parsed.messages_text is None


@pytest.mark.parametrize("field", ["messages", "input"])  # a chat body, a Responses body
def test_a_body_has_the_same_depth_bound_in_its_conversation_and_elsewhere(field: str) -> None:
    def body(conversation_levels: int, other_levels: int) -> bytes:
        return json.dumps({field: [nested(conversation_levels - 2)], "x": nested(
            other_levels - 1)}).encode()  # fmt: skip

    for _ in range(2):  # the wrapper chain is reused
        loads_chat_body(body(MAX_BODY_DEPTH, MAX_BODY_DEPTH))
        for bad in (body(MAX_BODY_DEPTH + 1, 3), body(3, MAX_BODY_DEPTH + 1), body(3, 300)):
            with pytest.raises(TooDeepError, match=f"deeper than {MAX_BODY_DEPTH} levels"):
                loads_chat_body(bad)
            with pytest.raises(TooDeepError):
                loads_body(bad)  # the same bound as the plain parse


RESPONSES_BODIES = [
    {"model": "m", "input": [{"role": "user", "content": 'hi é \u2028 "q" \\ 😀'}]},
    {"input": [], "instructions": "be brief", "tools": [{"type": "function", "name": "f"}]},
    {"input": [{"type": "message", "role": "user", "content": "alone"}]},  # no other field
    {"tools": [{"parameters": {"a": [[{"b": "]"}]]}}], "input": [{"x": "["}], "y": "["},
]


@pytest.mark.parametrize("body", RESPONSES_BODIES)
def test_a_responses_body_comes_with_its_input_text_between_head_and_tail(body: Any) -> None:
    parsed = loads_chat_body(json.dumps(body).encode())
    assert parsed.value == body and list(parsed.value) == list(body)  # key order kept
    conversation = parsed.conversation_text()
    assert conversation is not None and conversation.field == "input"
    text = conversation.text
    assert text[conversation.head : len(text) - conversation.tail] == orjson.dumps(body["input"])


@pytest.mark.parametrize("field", ["messages", "input"])
@pytest.mark.parametrize(
    "others",
    [
        {},
        {"system": "s" * 20_000, "model": "m"},  # a Messages body's long system prompt
        {"tools": [{"description": "nul \x00 ] [ \\u0000"}], "stop": "\x00"},
        {"a": [[[["]"]]]], "b": None, "c": 1.5, "d": {"e": ["\x00"]}},
    ],
)
def test_a_conversation_list_is_found_after_any_other_values(
    field: str, others: dict[str, Any]
) -> None:
    """The list's text is found by a marker the depth check writes before it, whatever
    the other values hold (NUL characters in strings are escaped, never raw)."""
    items = [{"role": "user", "content": "a\x00b"}, {"role": "assistant", "content": "c"}]
    for body in ({**others, field: items}, {field: items, **others}):
        parsed = loads_chat_body(json.dumps(body).encode())
        assert parsed.value == body and list(parsed.value) == list(body)
        conversation = parsed.conversation_text()
        assert conversation is not None and conversation.field == field
        text = conversation.text
        assert text[conversation.head : len(text) - conversation.tail] == orjson.dumps(items)


@pytest.mark.parametrize("size", [10, SPLICE_MIN_BYTES - 1, SPLICE_MIN_BYTES, 40_000])
def test_a_history_text_is_spliced_from_its_bound_on_and_sent_as_the_same_bytes(
    size: int,
) -> None:
    """A dialect turn's messages text (bytes of its own): spliced into the upstream
    request from :data:`SPLICE_MIN_BYTES` on, the request written is the one written
    with the text as a fragment."""
    messages = [{"role": "system", "content": "x" * size}, {"role": "user", "content": "é"}]
    text = orjson.dumps(messages)
    spliced = spliced_history(text)
    assert type(spliced) is (memoryview if len(text) >= SPLICE_MIN_BYTES else bytes)
    assert bytes(spliced) == text
    body = {"model": "a", "messages": messages, "stop": ["\x00"], "stream": True}
    upstream = {"model": "m", "sampling_params": {"temperature": 0.5}, "max_tokens": 7}
    sent = [
        dumps_request(build_upstream_request(body, messages_text=each, **upstream))
        for each in (spliced, text)
    ]
    assert (
        sent[0]
        == sent[1]
        == orjson.dumps(build_upstream_request(body, messages_text=None, **upstream))
    )
