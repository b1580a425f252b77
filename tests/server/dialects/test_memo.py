"""A rollout's next request translates only what is new, and means what a full
translation makes of it, whatever the agent did to its history."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_gateway.server.dialects import AnthropicDialect, ResponsesDialect
from rollout_gateway.server.dialects.base import Dialect, ParsedRequest
from rollout_gateway.server.dialects.errors import RequestError
from rollout_gateway.server.dialects.memo import extends, shared_prefix
from rollout_gateway.server.http.jsonio import ConversationText, loads_chat_body

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())["body"]


def claude_turn(body: dict[str, Any], i: int) -> dict[str, Any]:
    """``body`` with one more exchange (Claude Code moves its cache marker to the newest)."""
    messages = copy.deepcopy(body["messages"])
    for message in messages:
        for block in message["content"] if isinstance(message["content"], list) else ():
            block.pop("cache_control", None)
    call = {"type": "tool_use", "id": f"t{i}", "name": "Bash", "input": {"command": f"ls {i}"}}
    thinking = {"type": "thinking", "thinking": f"step {i}", "signature": ""}
    result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"out {i}"}
    result["cache_control"] = {"type": "ephemeral"}
    messages += [
        {"role": "assistant", "content": [thinking, {"type": "text", "text": f"run {i}"}, call]},
        {"role": "user", "content": [result]},
    ]
    return {**body, "messages": messages}


def codex_turn(body: dict[str, Any], i: int) -> dict[str, Any]:
    items = copy.deepcopy(body["input"])
    items += [
        {"type": "reasoning", "id": f"rs{i}", "summary": [], "content": [
            {"type": "reasoning_text", "text": f"step {i}"}]},
        {"type": "function_call", "call_id": f"c{i}", "name": "exec_command", "arguments": "{}"},
        {"type": "function_call_output", "call_id": f"c{i}", "output": f"out {i}"},
    ]  # fmt: skip
    return {**body, "input": items}


def wire_parse(dialect: Dialect, body: dict[str, Any], memo: Any, texts: bool) -> ParsedRequest:
    """``body`` sent and parsed as the gateway does: afresh from its bytes, with the text
    of its conversation the intake wrote (``texts``) or without."""
    parsed = loads_chat_body(orjson.dumps(body))
    return dialect.parse(parsed.value, memo, parsed.conversation_text() if texts else None)


def same(with_memo: ParsedRequest, without: ParsedRequest) -> None:
    # The previous request's text extended by the new messages' is the messages' JSON.
    assert with_memo.messages_text == orjson.dumps(with_memo.messages)
    assert with_memo.messages_text == without.messages_text
    assert with_memo.body == without.body
    assert with_memo.facts == without.facts
    assert with_memo.context == without.context


CASES = [
    (AnthropicDialect(), fixture("claude_code_first_turn.json"), claude_turn, "messages"),
    (ResponsesDialect(), fixture("codex_first_turn.json"), codex_turn, "input"),
]


@pytest.mark.parametrize("texts", [False, True])
@pytest.mark.parametrize(("dialect", "first", "grow", "key"), CASES)
def test_a_growing_conversation_translates_as_a_whole_one(
    dialect: Dialect, first: dict[str, Any], grow: Any, key: str, texts: bool
) -> None:
    body, memo = first, None
    for turn in range(6):
        parsed = wire_parse(dialect, body, memo, texts)
        same(parsed, dialect.parse(copy.deepcopy(body)))
        if turn >= 2:  # the history's messages are taken from the memo, not translated
            assert memo is not None
            reused = memo.conversation.messages
            assert all(parsed.messages[i] is reused[i] for i in range(len(reused) - 2))
        assert (parsed.memo.conversation.text is not None) is texts
        memo = parsed.memo
        body = grow(body, turn)
    assert memo is not None and memo.conversation.native  # the last request is kept


@pytest.mark.parametrize("texts", [False, True])
@pytest.mark.parametrize(("dialect", "first", "grow", "key"), CASES)
def test_any_rewrite_of_the_history_is_translated_afresh(
    dialect: Dialect, first: dict[str, Any], grow: Any, key: str, texts: bool
) -> None:
    rng = random.Random(7)
    body = first
    for turn in range(4):
        body = grow(body, turn)
    memo = wire_parse(dialect, body, None, texts).memo
    kept = orjson.dumps(memo.conversation.messages)
    for _ in range(40):
        edited = copy.deepcopy(body)
        native = edited[key]
        what = rng.choice(["edit", "drop", "cut", "system", "reorder", "extend"])
        index = rng.randrange(len(native))
        if what == "edit":
            native[index] = {"role": "user", "content": f"rewritten {index}"}
        elif what == "drop":
            del native[index]
        elif what == "cut":
            del native[index + 1 :]
        elif what == "reorder":  # the same values, another key order: other JSON text
            native[index] = dict(reversed(list(native[index].items())))
        elif what == "extend":
            native.append({"role": "user", "content": "more"})
        else:
            edited["system" if key == "messages" else "instructions"] = "another system"
        if not native:
            continue
        fresh = dialect.parse(copy.deepcopy(edited))
        same(wire_parse(dialect, edited, memo, texts), fresh)
    assert orjson.dumps(memo.conversation.messages) == kept  # a memo is never changed


def test_a_text_extends_only_a_list_whose_items_it_repeats() -> None:
    def text(items: Any, field: str = "input") -> ConversationText:
        parsed = loads_chat_body(orjson.dumps({field: items}))
        conversation = parsed.conversation_text()
        assert conversation is not None
        return conversation

    assert extends(text([{"a": 1}, 2]), text([{"a": 1}]))
    assert extends(text([{"a": 1}]), text([{"a": 1}]))  # the same list
    assert not extends(text([]), text([1]))
    assert not extends(text([1]), text([]))  # (from none: the objects are compared)
    assert not extends(text(["abc"]), text(["ab"]))  # a longer string is another item
    assert not extends(text([123]), text([12]))  # so is a longer number
    assert not extends(text([{"a": 1, "b": 2}]), text([{"b": 2, "a": 1}]))  # key order
    assert not extends(text([1, 2], "messages"), text([1]))  # another field's list
    assert extends(text([1, 2], "messages"), text([1], "messages"))  # written cut out


def test_an_open_run_of_assistant_items_is_not_reused() -> None:
    """A request ending inside a run of assistant items (a prefill): the next request's
    longer run is folded whole."""
    dialect = ResponsesDialect()
    start = [{"role": "user", "content": "hi"}, {"type": "reasoning", "id": "r", "summary": []}]
    memo = dialect.parse({"model": "m", "input": copy.deepcopy(start)}).memo
    more = [*start, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    body = {"model": "m", "input": more}
    same(dialect.parse(copy.deepcopy(body), memo), dialect.parse(copy.deepcopy(body)))


def test_another_rollouts_memo_costs_only_a_full_translation() -> None:
    dialect = AnthropicDialect()
    other = dialect.parse(fixture("claude_code_after_tool.json")).memo
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert dialect.parse(copy.deepcopy(body), other).messages == [{"role": "user", "content": "hi"}]


def test_shared_prefix() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert shared_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert shared_prefix([1, 5, 3], [1, 2, 3]) == 1
    assert shared_prefix([1], [1, 2]) == 1
    assert shared_prefix([], [1]) == 0


@pytest.mark.parametrize("pad", [0, 20_000])  # a copied prefix, and a memoryview's
def test_a_long_text_extends_as_a_short_one_does(pad: int) -> None:
    def text(items: list[Any]) -> ConversationText:
        conversation = loads_chat_body(orjson.dumps({"input": items})).conversation_text()
        assert conversation is not None
        return conversation

    head = {"role": "developer", "content": "x" * pad}
    assert extends(text([head, {"a": 1}, 2]), text([head, {"a": 1}]))
    assert extends(text([head]), text([head]))
    assert not extends(text([{**head, "content": "x" * pad + "y"}, 2]), text([head]))
    assert not extends(text([head, "abc"]), text([head, "ab"]))
    assert not extends(text([head]), text([head, 1]))


@pytest.mark.parametrize("bad", [7, "text", None, ["a list"]])
def test_a_new_item_that_is_no_object_is_refused_after_a_repeated_history(bad: Any) -> None:
    """Only the items after the previous request's (repeated, as its text shows) are
    checked to be objects: a new one that is not is refused as a fresh parse refuses it."""
    dialect = ResponsesDialect()
    first = {"model": "m", "input": [{"role": "user", "content": "hi"}]}
    memo = wire_parse(dialect, first, None, texts=True).memo
    assert memo.conversation.text is not None
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}, bad]}
    with pytest.raises(RequestError) as fresh:
        dialect.parse(copy.deepcopy(body))
    with pytest.raises(RequestError) as after:
        wire_parse(dialect, body, memo, texts=True)
    assert (after.value.message, after.value.param) == (fresh.value.message, fresh.value.param)
    assert after.value.param == "input[1]"
