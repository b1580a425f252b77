"""A dialect body parsed from the previous body's bytes is what a parse of it builds,
whatever the agent changed, added or broke in its bytes."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_gateway.server.http.body_prefix import (
    MAX_MISSES,
    UNWRITTEN,
    BodyPrefix,
    loads_extending,
)
from rollout_gateway.server.http.jsonio import (
    MAX_BODY_DEPTH,
    SPLICE_MIN_BYTES,
    ParsedBody,
    TooDeepError,
    loads_chat_body,
)

FIXTURES = Path(__file__).parents[1] / "dialects" / "fixtures"


def first_body(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / name).read_text())["body"]
    return body


def grown(body: dict[str, Any], key: str, i: int) -> dict[str, Any]:
    """``body`` with two more items in its conversation ``key``."""
    if key == "input":
        more: list[Any] = [
            {"type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": f"said {i}", "annotations": []}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": f"go on é {i}"}]},
        ]  # fmt: skip
    else:
        more = [
            {"role": "assistant", "content": [{"type": "text", "text": f"said {i}"}]},
            {"role": "user", "content": [{"type": "text", "text": f"go on é {i}"}]},
        ]
    return {**body, key: [*body[key], *more]}


def same_parse(parsed: ParsedBody, raw: bytes) -> None:
    """``parsed`` holds what a parse of ``raw`` builds, keys in the same order."""
    fresh = loads_chat_body(raw).value
    assert parsed.value == fresh
    assert orjson.dumps(parsed.value) == orjson.dumps(fresh)


def outcome(raw: bytes, previous: BodyPrefix | None) -> Any:
    try:
        parsed = loads_extending(raw, previous)
    except ValueError as exc:
        return type(exc), str(exc)
    return orjson.dumps(parsed.value)


def fresh_outcome(raw: bytes) -> Any:
    try:
        parsed = loads_chat_body(raw)
    except ValueError as exc:
        return type(exc), str(exc)
    return orjson.dumps(parsed.value)


CASES = [
    ("codex_first_turn.json", "input"),
    ("claude_code_first_turn.json", "messages"),
]


@pytest.mark.parametrize(("name", "key"), CASES)
def test_a_growing_conversation_parses_only_its_new_items(name: str, key: str) -> None:
    body, previous = first_body(name), None
    for turn in range(6):
        raw = orjson.dumps(body)
        parsed = loads_extending(raw, previous)
        same_parse(parsed, raw)
        assert parsed.prefix is not None and parsed.prefix.field == key
        if previous is None:  # the chain starts with a whole parse
            assert parsed.conversation is not None or parsed.messages_text is not None
        else:  # then the repeated items are the previous body's very objects
            assert parsed.conversation is None and parsed.messages_text is None
            items = parsed.value[key]
            assert items is not previous.items
            assert all(a is b for a, b in zip(items, previous.items, strict=False))
        previous = parsed.prefix
        body = grown(body, key, turn)


@pytest.mark.parametrize(("name", "key"), CASES)
def test_a_history_one_byte_off_is_parsed_whole(name: str, key: str) -> None:
    body = grown(grown(first_body(name), key, 0), key, 1)
    raw = orjson.dumps(body)
    previous = loads_extending(raw).prefix
    assert previous is not None and previous.raw  # a chain, not UNWRITTEN
    nxt = orjson.dumps(grown(body, key, 2))
    for at in range(previous.start + 1, previous.end):  # every byte of the history
        if nxt[at] in b'\\"':
            continue
        changed = nxt[:at] + (b"a" if nxt[at] != ord("a") else b"b") + nxt[at + 1 :]
        assert outcome(changed, previous) == fresh_outcome(changed)
    for at in (0, len(nxt) - 1, len(nxt) - 3):  # the body's other values
        changed = nxt[:at] + b" " + nxt[at:]
        assert outcome(changed, previous) == fresh_outcome(changed)


@pytest.mark.parametrize(
    "added",
    [
        b",",  # a comma of no item
        b", ",
        b',1],"x":[2',  # the list closed early, another value after it
        b',{"a":1}],"input":[2',  # a second "input" list: the last one counts
        b',{"a":1}],"messages":[2',
        b',{"a":1}],"\\u0069nput":[2',
        b',{"a":1}]}',
        b',{"a":1}',
        b',{"a":1}]',
        b',{"a":"\xff"}',  # not UTF-8
        b',{"a":"\\ud800"}',  # a lone surrogate
        b',{"a":1e400}',
        b', {"a" : 1} ,\n{}',  # not written as orjson writes: still exact
        b"," + b"[" * 200 + b"]" * 200,  # too deep
        b"," + b"[" * (MAX_BODY_DEPTH - 2) + b"]" * (MAX_BODY_DEPTH - 2),  # just deep enough
        b"," + b"[" * (MAX_BODY_DEPTH - 1) + b"]" * (MAX_BODY_DEPTH - 1),  # one level too deep
    ],
)
@pytest.mark.parametrize(("name", "key"), CASES)
def test_what_follows_the_history_is_read_as_a_whole_parse_reads_it(
    name: str, key: str, added: bytes
) -> None:
    raw = orjson.dumps(grown(first_body(name), key, 0))
    previous = loads_extending(raw).prefix
    assert previous is not None and previous.raw  # a chain, not UNWRITTEN
    changed = raw[: previous.end] + added + raw[previous.end :]
    assert outcome(changed, previous) == fresh_outcome(changed)
    if added.count(b"[") > MAX_BODY_DEPTH:
        with pytest.raises(TooDeepError):
            loads_extending(changed, previous)


@pytest.mark.parametrize(("name", "key"), CASES)
def test_random_edits_of_the_bytes_parse_as_a_whole_parse_does(name: str, key: str) -> None:
    rng = random.Random(31)
    body = grown(first_body(name), key, 0)
    previous = loads_extending(orjson.dumps(body)).prefix
    assert previous is not None and previous.raw  # a chain, not UNWRITTEN
    nxt = orjson.dumps(grown(body, key, 1))
    for _ in range(300):
        at = rng.randrange(len(nxt))
        what = rng.choice(["insert", "delete", "replace"])
        byte = bytes([rng.choice(b'{}[],:"\\ a0\n')])
        if what == "insert":
            changed = nxt[:at] + byte + nxt[at:]
        elif what == "delete":
            changed = nxt[:at] + nxt[at + 1 :]
        else:
            changed = nxt[:at] + byte + nxt[at + 1 :]
        assert outcome(changed, previous) == fresh_outcome(changed)


def test_the_same_body_again_is_the_previous_ones_values() -> None:
    raw = orjson.dumps(first_body("codex_first_turn.json"))
    previous = loads_extending(raw).prefix
    assert previous is not None and previous.raw  # a chain, not UNWRITTEN
    again = loads_extending(raw, previous)
    same_parse(again, raw)
    assert again.value["input"] is not previous.items  # a list of its own
    assert again.prefix is not None and again.prefix.end == previous.end


def test_a_body_not_written_as_orjson_writes_it_starts_no_chain() -> None:
    body = first_body("codex_first_turn.json")
    spaced = json.dumps(body).encode()  # ", " and ": "
    assert loads_extending(spaced).prefix is UNWRITTEN
    reordered = orjson.dumps(dict(reversed(list(body.items()))))
    assert loads_extending(reordered).prefix not in (None, UNWRITTEN)  # any key order
    twice = orjson.dumps(body)[:-1] + b',"input":' + orjson.dumps(body["input"]) + b"}"
    assert loads_extending(twice).prefix is UNWRITTEN  # a repeated key: not its writing
    assert loads_extending(orjson.dumps({**body, "input": "hi"})).prefix is None
    # The rollout's next bodies are parsed whole, and not tried.
    nxt = orjson.dumps(grown(body, "input", 0))
    parsed = loads_extending(nxt, UNWRITTEN)
    same_parse(parsed, nxt)
    assert parsed.prefix is UNWRITTEN and parsed.conversation is not None


def test_a_long_history_chains_as_a_short_one() -> None:
    body = copy.deepcopy(first_body("claude_code_first_turn.json"))
    body["messages"][0]["content"] = "é\x00 x" * (SPLICE_MIN_BYTES // 4)  # a view's text
    previous = None
    for turn in range(3):
        raw = orjson.dumps(body)
        parsed = loads_extending(raw, previous)
        same_parse(parsed, raw)
        assert parsed.prefix is not None
        previous = parsed.prefix
        body = grown(body, "messages", turn)


def test_a_body_changed_after_its_parse_leaves_the_next_parse_alone() -> None:
    """The body handed out is a dict of its own: what its caller sets or drops in it is
    not the next body's."""
    body = first_body("claude_code_first_turn.json")
    parsed = loads_extending(orjson.dumps(body))
    for turn in range(3):
        parsed.value["model"] = "changed"
        parsed.value.pop("max_tokens", None)
        parsed.value["messages"].append({"role": "user", "content": "appended"})
        body = grown(body, "messages", turn)
        raw = orjson.dumps(body)
        parsed = loads_extending(raw, parsed.prefix)
        same_parse(parsed, raw)
        assert parsed.conversation is None and parsed.messages_text is None  # a chain


@pytest.mark.parametrize("key", ["input", "messages"])
def test_an_empty_history_then_a_comma_is_refused_as_a_whole_parse_refuses_it(key: str) -> None:
    """``[]`` then ``[,item]``: no JSON (the comma follows no item), so no chain may read
    it as ``[item]``; a well-formed next body still parses."""
    raw = orjson.dumps({"model": "m", key: []})
    previous = loads_extending(raw).prefix
    assert previous is not None
    bad = raw.replace(b"[]", b'[,{"role":"user","content":"x"}]')
    assert outcome(bad, previous) == fresh_outcome(bad)
    assert isinstance(fresh_outcome(bad), tuple)  # refused
    good = raw.replace(b"[]", b'[{"role":"user","content":"x"}]')
    same_parse(loads_extending(good, previous), good)


def test_bodies_that_never_extend_the_previous_one_stop_the_chain() -> None:
    """An agent that rewrites its history before its last item every turn (a turn count
    in its first message): after :data:`MAX_MISSES` such bodies in a row the rollout is
    not tried again."""
    body = first_body("claude_code_first_turn.json")
    previous = None
    for turn in range(MAX_MISSES + 1):
        body = grown(body, "messages", turn)
        rewritten = copy.deepcopy(body)
        rewritten["messages"][0]["content"][0]["text"] += f" (turn {turn})"
        raw = orjson.dumps(rewritten)
        parsed = loads_extending(raw, previous)
        same_parse(parsed, raw)
        assert parsed.messages_text is not None  # parsed whole every time
        previous = parsed.prefix
        assert previous is not None
        if turn < MAX_MISSES:
            assert previous is not UNWRITTEN and previous.misses == turn
    assert previous is UNWRITTEN


def claude_code_turn(body: dict[str, Any], i: int) -> dict[str, Any]:
    """``body``'s next turn as Claude Code writes it: the cache breakpoint leaves the
    last message (a system message it marked goes back to a string) for the newest."""
    messages = copy.deepcopy(body["messages"])
    last = messages[-1]
    if last["role"] == "system":
        last["content"] = last["content"][0]["text"]
    elif isinstance(last["content"], list):
        for block in last["content"]:
            block.pop("cache_control", None)
    messages += [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{i}", "name": "Bash",
             "input": {"command": f"ls {i}"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"out é {i}",
             "is_error": False, "cache_control": {"type": "ephemeral"}}]},
    ]  # fmt: skip
    return {**body, "messages": messages}


def test_a_cache_breakpoint_moved_from_the_last_message_still_chains() -> None:
    """Claude Code's bodies: only the last message's bytes change (its breakpoint moves
    to the newest); the messages before it are not parsed again, and the body is a whole
    parse's, turn after turn."""
    body = first_body("claude_code_first_turn.json")
    marked = copy.deepcopy(body)
    marked["messages"].append(
        {"role": "system", "content": [
            {"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}]}
    )  # fmt: skip
    raw = orjson.dumps(marked)
    previous = loads_extending(raw).prefix
    assert previous is not None and previous.raw  # a chain, not UNWRITTEN
    body = marked
    for turn in range(5):
        body = claude_code_turn(body, turn)
        raw = orjson.dumps(body)
        parsed = loads_extending(raw, previous)
        same_parse(parsed, raw)
        assert parsed.messages_text is None  # chained: the history not parsed again
        items = parsed.value["messages"]
        kept = len(previous.items) - 1
        assert all(a is b for a, b in zip(items[:kept], previous.items[:kept], strict=True))
        assert items[kept] is not previous.items[kept]  # the rewritten one, parsed
        previous = parsed.prefix
        assert previous is not None and previous.misses == 0


@pytest.mark.parametrize(
    "rewritten",
    [
        b"",  # no item after a comma
        b",",
        b" ",
        b'1],"x":[2',  # the list closed early, another value after it
        b'{"a":1}],"messages":[2',  # a second "messages" list: the last one counts
        b'{"a":1}]}',
        b'{"a":1}',
        b'{"a":1}]',
        b'{"a":"\xff"}',  # not UTF-8
        b'{"a":"\ud800"}',  # a lone surrogate
        b'{"a":1e400}',
        b' {"a" : 1} ,\n{}',  # not written as orjson writes: still exact
        b"[" * 200 + b"]" * 200,  # too deep
        b"[" * (MAX_BODY_DEPTH - 2) + b"]" * (MAX_BODY_DEPTH - 2),  # just deep enough
        b"[" * (MAX_BODY_DEPTH - 1) + b"]" * (MAX_BODY_DEPTH - 1),  # one level too deep
    ],
)
@pytest.mark.parametrize("items", [1, 3])
def test_a_rewritten_last_item_is_read_as_a_whole_parse_reads_it(
    rewritten: bytes, items: int
) -> None:
    body = first_body("claude_code_first_turn.json")
    body = {**body, "messages": body["messages"][:1] * items}
    raw = orjson.dumps(body)
    previous = loads_extending(raw).prefix
    assert previous is not None and previous.raw  # a chain, not UNWRITTEN
    last = previous.end - len(orjson.dumps(body["messages"][-1]))
    changed = raw[:last] + rewritten + raw[previous.end :]
    assert outcome(changed, previous) == fresh_outcome(changed)


def test_a_last_item_not_written_as_orjson_writes_it_is_not_rewritten_in_a_chain() -> None:
    """Where the last item starts is known only when it is orjson's writing: a body that
    rewrites one written otherwise is parsed whole (and still exactly)."""
    body = first_body("claude_code_first_turn.json")
    previous = loads_extending(orjson.dumps(body)).prefix
    assert previous is not None
    raw = previous.raw
    spaced = raw[: previous.end] + b', {"role" : "user", "content" : "x"}' + raw[previous.end :]
    parsed = loads_extending(spaced, previous)
    same_parse(parsed, spaced)
    assert parsed.messages_text is None and parsed.prefix is not None  # chained
    cut = spaced.rindex(b'{"role" : "user"')
    nxt = spaced[:cut] + b'{"role":"user","content":"y"}' + spaced[parsed.prefix.end :]
    again = loads_extending(nxt, parsed.prefix)
    same_parse(again, nxt)
    assert again.messages_text is not None  # parsed whole


def test_new_values_after_the_history_every_turn_still_chain() -> None:
    """As Codex writes a new ``client_metadata`` after its ``input`` every turn: the
    history is not parsed again; what follows it is, and the body is a whole parse's."""
    body = first_body("codex_first_turn.json")
    previous = loads_extending(orjson.dumps(body)).prefix
    for turn in range(4):
        body = {**grown(body, "input", turn), "client_metadata": {"turn_id": f"t{turn}"}}
        if turn == 2:
            body["extra"] = [1, {"x": "y"}]  # a value more, after the history
        raw = orjson.dumps(body)
        parsed = loads_extending(raw, previous)
        same_parse(parsed, raw)
        assert parsed.conversation is None  # chained: the history not parsed again
        previous = parsed.prefix
        assert previous is not None and previous.misses == 0
    # Values after it not written as orjson writes them: parsed whole, and no chain.
    spaced = orjson.dumps(grown(body, "input", 9))[:-1] + b' , "z": 1}'
    parsed = loads_extending(spaced, previous)
    same_parse(parsed, spaced)
    assert parsed.conversation is not None and parsed.prefix is UNWRITTEN


def test_a_history_rewritten_once_between_extensions_keeps_the_chain() -> None:
    """A compaction rewrites the history once; the bodies after it extend it again."""
    body = grown(first_body("codex_first_turn.json"), "input", 0)
    previous = loads_extending(orjson.dumps(body)).prefix
    compacted = {**body, "input": body["input"][:1]}
    for turn in range(2 * MAX_MISSES):
        raw = orjson.dumps(compacted)
        parsed = loads_extending(raw, previous)  # a miss, then a chain from it
        same_parse(parsed, raw)
        assert parsed.prefix is not None and parsed.prefix.misses == 1
        raw = orjson.dumps(grown(compacted, "input", turn))
        extended = loads_extending(raw, parsed.prefix)
        same_parse(extended, raw)
        assert extended.conversation is None and extended.prefix is not None
        assert extended.prefix.misses == 0
        previous = extended.prefix
