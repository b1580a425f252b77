"""Recorded trajectories: token fields vs the scripted tokenizer, history, truncation."""

from __future__ import annotations

import pytest

from rollout_gateway.scripted import tokenizer as tok
from rollout_gateway.server.recording.recorder import TrajectoryRecorder, message_key, same_message

from ..conftest import GatewayHarness, RecordingUpstream, script

TOOL_STEP = {"tool": "run", "arguments": {"cmd": "ls"}}


def tool_call_text(name: str, arguments: str) -> str:
    return tok.render_tool_call(name, arguments)


async def run_two_turns(gw: GatewayHarness, rollout_id: str = "r1") -> list[dict]:
    """Turn 1: a tool call; turn 2: text. Returns the second request's messages."""
    messages = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": script(TOOL_STEP, {"say": "finished"})},
    ]
    first = (await gw.chat(rollout_id, messages)).json()
    assistant = first["choices"][0]["message"]
    call = assistant["tool_calls"][0]
    messages = [
        *messages,
        assistant,
        {"role": "tool", "tool_call_id": call["id"], "content": "a.txt b.txt"},
    ]
    second = await gw.chat(rollout_id, messages)
    assert second.status_code == 200
    return messages


async def test_multi_turn_token_fields_match_the_tokenizer(gw: GatewayHarness) -> None:
    await gw.register("r1", max_seq_len=10_000)
    messages2 = await run_two_turns(gw)
    messages1 = messages2[:2]
    traj = (await gw.trajectory("r1")).json()
    steps = traj["trajectory"]
    assert len(steps) == 2 and traj["num_turns"] == 2

    call_text = tool_call_text("run", '{"cmd": "ls"}')
    expected = [
        (tok.encode_prompt(messages1), tok.encode_completion(call_text)),
        (tok.encode_prompt(messages2), tok.encode_completion("finished")),
    ]
    for step, (prompt_ids, completion_ids) in zip(steps, expected, strict=True):
        t = step["tokens"]
        assert t["prompt_ids"] == prompt_ids
        assert t["prompt_mask"] == [0] * len(prompt_ids)
        assert t["completion_ids"] == completion_ids
        assert t["completion_mask"] == [1] * len(completion_ids)
        assert t["completion_logprobs"] == pytest.approx(
            [tok.token_logprob(i) for i in completion_ids], rel=1e-6
        )
        assert t["overlong_prompt"] is False and t["is_truncated"] is False
        assert step["is_truncated"] is False
        assert step["reward"] is None and step["advantage"] is None
        assert step["extras"]["status"] == "ok" and "history_rewritten" not in step["extras"]
    assert [s["extras"]["finish_reason"] for s in steps] == ["tool_calls", "stop"]
    assert steps[1]["extras"]["prefix_break"] is False  # the scripted template extends
    # Both turns share the rollout's trajectory id, a uuid.
    assert steps[0]["trajectory_id"] == steps[1]["trajectory_id"]
    assert len(steps[0]["trajectory_id"]) == 36

    # Step messages: the request's messages and the assistant answer.
    assert steps[0]["prompt"] == messages1
    assert steps[0]["completion"][0]["tool_calls"][0]["function"]["name"] == "run"
    assert steps[1]["prompt"] == messages2
    assert steps[1]["completion"] == [{"role": "assistant", "content": "finished"}]
    # Top level: first prompt, then everything after it.
    assert traj["prompt"] == messages1
    assert traj["completion"] == [*messages2[2:], {"role": "assistant", "content": "finished"}]
    assert traj["is_truncated"] is False


async def test_rewritten_history_is_recorded_as_is(gw: GatewayHarness) -> None:
    await gw.register("r1")
    await run_two_turns(gw)
    other = [{"role": "user", "content": "a summary of the conversation so far"}]
    assert (await gw.chat("r1", other)).status_code == 200
    steps = (await gw.trajectory("r1")).json()["trajectory"]
    assert steps[2]["extras"]["history_rewritten"] is True
    assert steps[2]["extras"]["prefix_break"] is True
    assert steps[2]["prompt"] == other
    assert steps[2]["tokens"]["prompt_ids"] == tok.encode_prompt(other)
    # Earlier steps are unaffected.
    assert "history_rewritten" not in steps[1]["extras"]
    assert len(steps[1]["prompt"]) == 4


async def test_no_token_fields_upstream_gives_tokens_null(make_gateway) -> None:
    upstream = RecordingUpstream(with_tokens=False)
    gw = await make_gateway(upstream.app())
    await gw.register("r1")
    await run_two_turns(gw)
    traj = (await gw.trajectory("r1")).json()
    assert traj["num_turns"] == 2
    assert [s["tokens"] for s in traj["trajectory"]] == [None, None]
    assert traj["trajectory"][1]["completion"] == [{"role": "assistant", "content": "finished"}]


async def test_overlong_prompt_and_truncation(gw: GatewayHarness) -> None:
    messages = [{"role": "user", "content": script({"say": "x" * 40})}]
    prompt_len = len(tok.encode_prompt(messages))
    await gw.register("long", max_seq_len=prompt_len - 1)
    await gw.chat("long", messages)
    step = (await gw.trajectory("long")).json()["trajectory"][0]
    assert step["tokens"]["overlong_prompt"] is True
    assert step["tokens"]["is_truncated"] is True and step["is_truncated"] is True

    await gw.register("fits", max_seq_len=prompt_len + 10)  # completion does not fit
    await gw.chat("fits", messages)
    traj = (await gw.trajectory("fits")).json()
    assert traj["trajectory"][0]["tokens"]["overlong_prompt"] is False
    assert traj["trajectory"][0]["is_truncated"] is True and traj["is_truncated"] is True


async def test_finish_reason_length_marks_truncated(gw: GatewayHarness) -> None:
    await gw.register("r1", sampling_params={"max_tokens": 5})
    r = await gw.chat("r1", [{"role": "user", "content": script({"say": "a long answer"})}])
    assert r.json()["choices"][0]["finish_reason"] == "length"
    step = (await gw.trajectory("r1")).json()["trajectory"][0]
    assert step["is_truncated"] is True
    assert step["tokens"]["completion_ids"] == tok.encode_text("a lon")


def test_recorder_shares_prefixes_and_rebuilds_steps() -> None:
    rec = TrajectoryRecorder("tid", max_seq_len=None)
    history: list[dict] = [{"role": "user", "content": "start"}]
    expected = []
    for turn in range(30):
        prompt_ids = tok.encode_prompt(history)
        completion = {"role": "assistant", "content": f"answer {turn} " * 20}
        completion_ids = tok.encode_completion(completion["content"])
        logprobs = [tok.token_logprob(i) for i in completion_ids]
        rec.record(
            history,
            [completion],
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            completion_logprobs=logprobs,
            finish_reason="stop",
        )
        expected.append((list(history), prompt_ids, completion_ids))
        history = [*history, completion, {"role": "user", "content": f"go on {turn}"}]
    steps = rec.steps()
    for step, (prompt, prompt_ids, completion_ids) in zip(steps, expected, strict=True):
        assert step["prompt"] == prompt
        assert step["tokens"]["prompt_ids"] == prompt_ids
        assert step["tokens"]["completion_ids"] == completion_ids
    # Memory grows with unique tokens, not with the sum over turns of the context.
    final_len = len(expected[-1][1]) + len(expected[-1][2])
    assert rec.logical_token_count() > 10 * final_len
    assert rec.token_storage_bytes() < 16 * final_len


def test_history_echoed_in_another_form_is_shared_and_a_rewrite_anywhere_is_caught() -> None:
    """An SDK that re-serialises each answer (extra fields, arguments re-spaced) still
    extends the history, turn after turn; a changed message before or after the point
    the previous turn's check got to is a rewrite."""
    rec = TrajectoryRecorder("tid")
    sent: list[dict] = [{"role": "user", "content": "start"}]
    for turn in range(6):
        assert rec.shared_messages(sent) == (len(sent) - 1 if turn else 0)
        answer = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"c{turn}", "type": "function",
                 "function": {"name": "run", "arguments": f'{{"cmd":"step {turn}"}}'}}
            ],
        }  # fmt: skip
        rec.record(sent, [answer])
        echo = {
            **answer,
            "refusal": None,  # a field the trajectory does not keep
            "tool_calls": [
                {**answer["tool_calls"][0],
                 "function": {"name": "run", "arguments": f'{{"cmd": "step {turn}"}}'}}
            ],
        }  # fmt: skip
        sent = [*sent, echo, {"role": "tool", "tool_call_id": f"c{turn}", "content": "ok"}]
    assert rec.shared_messages(sent) == len(sent) - 1
    assert rec.shared_messages(sent) == len(sent) - 1  # the same request checked again
    for index in (0, 1, len(sent) - 3):
        changed = [dict(m) for m in sent]
        changed[index]["content"] = "something else"
        assert rec.shared_messages(changed) is None, index
    assert rec.shared_messages(sent[:3]) is None  # shorter than the recorded history
    assert rec.shared_messages(sent) == len(sent) - 1


def test_malformed_token_fields_give_tokens_null() -> None:
    rec = TrajectoryRecorder("tid")
    msgs = [{"role": "user", "content": "x"}]
    done = [{"role": "assistant", "content": "y"}]
    rec.record(msgs, done, prompt_ids=[1, "2"], completion_ids=[3], completion_logprobs=[-1.0])
    rec.record(msgs, done, prompt_ids=[1], completion_ids=[3, 4], completion_logprobs=[-1.0])
    rec.record(msgs, done, prompt_ids=[1], completion_ids=[2**40], completion_logprobs=[-1.0])
    steps = rec.steps()
    assert [s["tokens"] for s in steps] == [None, None, None]
    assert all("tokens_error" in s["extras"] for s in steps)


async def test_delta_trajectory_rebuilds_the_full_one(gw) -> None:
    """``?format=delta`` holds each step's new messages and ids only; expanding it gives
    exactly the table's answer (abandoned turns and rewritten histories included)."""
    from rollout_gateway.protocol import delta_steps, expand_delta_steps

    from ..conftest import script

    await gw.register("d1")
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": script({"tool": "run", "arguments": {"cmd": "ls"}},
                                           {"tool": "run", "arguments": {"cmd": "pwd"}},
                                           {"say": "done"})},
    ]  # fmt: skip
    for _ in range(3):
        answer = (await gw.chat("d1", messages)).json()["choices"][0]["message"]
        messages = [*messages, answer]
        for call in answer.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "out"})
    await gw.chat("d1", [{"role": "user", "content": script({"say": "rewritten"})}])
    full = (await gw.trajectory("d1")).json()
    delta = (await gw.client.get("/v1/rollouts/d1/trajectory", params={"format": "delta"})).json()
    assert delta["format"] == "delta"
    assert expand_delta_steps(delta["trajectory"]) == full["trajectory"]
    # The delta form computed from full steps (what a gateway storing full steps sends).
    assert expand_delta_steps(delta_steps(full["trajectory"])) == full["trajectory"]
    assert {k: v for k, v in delta.items() if k not in ("trajectory", "format")} == {
        k: v for k, v in full.items() if k != "trajectory"
    }
    assert len(str(delta["trajectory"])) < len(str(full["trajectory"]))
    assert delta["trajectory"][1]["tokens"]["prompt_shared"] > 0


def test_prompt_ids_from_json_text_equal_the_parsed_path() -> None:
    """The recorder's fast path (only the bytes after the previous prompt are parsed)
    records exactly what parsing the whole array records, including when the history is
    rewritten or the previous prompt's last id is a prefix of a longer number."""
    import json

    from rollout_gateway.server.recording.prompt_ids import split_prompt_ids
    from rollout_gateway.server.recording.recorder import TrajectoryRecorder

    prompts = [
        [1, 2, 3, 12],
        [1, 2, 3, 12, 7, 8, 9],  # extends (the completion was 7, 8)
        [1, 2, 3, 123, 5],  # "12" -> "123": same bytes up to a non-boundary
        [1, 2, 3, 123, 5],  # identical prompt
        [9, 9],  # rewritten
        [9, 9, 4, 4, 4],
    ]
    by_list = TrajectoryRecorder("a")
    by_text = TrajectoryRecorder("b")
    for i, prompt in enumerate(prompts):
        answer = json.dumps({"prompt_token_ids": prompt, "choices": []}).encode()
        rest, text = split_prompt_ids(answer)
        assert json.loads(rest)["prompt_token_ids"] is None and json.loads(bytes(text)) == prompt
        turn = {"completion_ids": [7, 8], "completion_logprobs": [-0.1, -0.2]}
        messages = [{"role": "user", "content": str(i)}]
        completion = [{"role": "assistant", "content": "x"}]
        by_list.record(messages, completion, prompt_ids=prompt, **turn)
        by_text.record(messages, completion, prompt_ids_json=text, **turn)
    steps_a, steps_b = by_list.steps(), by_text.steps()
    for a, b in zip(steps_a, steps_b, strict=True):
        assert a["tokens"] == b["tokens"]
    assert [s["tokens"]["prompt_ids"] for s in steps_b] == prompts


def test_abandoned_step_that_extended_the_branch_is_undone() -> None:
    from rollout_gateway.server.recording.recorder import TrajectoryRecorder

    rec = TrajectoryRecorder("t")
    m1 = [{"role": "user", "content": "a"}]
    a1 = [{"role": "assistant", "content": "x"}]
    rec.record(m1, a1, prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.1])
    lost = [*m1, *a1, {"role": "user", "content": "lost"}]
    rec.record(lost, a1, prompt_ids=[1, 2, 3, 9], completion_ids=[8], completion_logprobs=[-1.0])
    rec.abandon_last()  # its answer reached nobody
    again = [*m1, *a1, {"role": "user", "content": "b"}]
    rec.record(again, a1, prompt_ids=[1, 2, 3, 4], completion_ids=[5], completion_logprobs=[-0.2])
    steps = rec.steps()
    assert [s["tokens"]["prompt_ids"] for s in steps] == [[1, 2], [1, 2, 3, 4]]
    assert [s["tokens"]["completion_ids"] for s in steps] == [[3], [5]]
    assert "history_rewritten" not in steps[1]["extras"] and rec.num_abandoned == 1
    assert rec.token_storage_bytes() <= 8 * 5


def test_same_message_agrees_with_message_key() -> None:
    def call(arguments: object, call_id: str = "c1", name: str = "run") -> dict:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    engine = {"role": "assistant", "content": None, "tool_calls": [call('{"cmd": "ls", "n": 1}')]}
    variants = [
        {"role": "assistant", "tool_calls": [call('{"cmd": "ls", "n": 1}')]},  # verbatim echo
        {
            "role": "assistant",
            "content": "",
            "refusal": None,
            "tool_calls": [call('{"n":1,"cmd":"ls"}')],
        },
        {"role": "assistant", "tool_calls": [call({"cmd": "ls", "n": 1})]},  # as an object
        {"role": "assistant", "tool_calls": [call('{"cmd": "ls", "n": 2}')]},
        {"role": "assistant", "tool_calls": [call('{"cmd": "ls", "n": 1.0}')]},
        {"role": "assistant", "tool_calls": [call('{"cmd": "ls", "n": 1}', call_id="c2")]},
        {"role": "assistant", "tool_calls": [call('{"cmd": "ls", "n": 1}', name="other")]},
        {"role": "assistant", "tool_calls": []},
        {"role": "user", "tool_calls": [call('{"cmd": "ls", "n": 1}')]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}], "tool_calls": [call("x")]},
        {"role": "assistant", "tool_calls": [call('{"a": NaN}')]},
    ]
    nan_call = {"role": "assistant", "tool_calls": [call('{"a":  NaN}')]}
    for a, b in [(engine, v) for v in variants] + [(nan_call, variants[-1])]:
        assert same_message(a, b) == (message_key(a) == message_key(b)), (a, b)
    assert [same_message(engine, v) for v in variants[:4]] == [True, True, True, False]


async def test_each_step_records_the_agents_tools_and_the_delta_form_sends_them_on_change(
    gw: GatewayHarness,
) -> None:
    """``extras.tools``: the tools of the turn's request, on every full step; in the delta
    form only when they change (expanding carries them forward); one stored list for the
    turns that sent the same tools."""
    from rollout_gateway.protocol import expand_delta_steps

    shell = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
    await gw.register("t1")
    turns = [[shell], [shell], [shell, other], []]
    for i, tools in enumerate(turns):
        body = {"messages": [{"role": "user", "content": f"turn {i}"}], "tools": tools}
        assert (await gw.chat("t1", body)).status_code == 200
    full = (await gw.trajectory("t1")).json()["trajectory"]
    assert [s["extras"]["tools"] for s in full] == turns
    delta = (await gw.trajectory("t1", params={"format": "delta"})).json()["trajectory"]
    assert ["tools" in s["extras"] for s in delta] == [True, False, True, True]
    assert [s["extras"]["tools"] for s in expand_delta_steps(delta)] == turns


def test_turns_with_the_same_tools_share_one_stored_list() -> None:
    rec = TrajectoryRecorder("t")
    tools = [{"type": "function", "function": {"name": "run"}}]
    for i in range(3):
        rec.record([{"role": "user", "content": str(i)}], [], extras={"tools": list(tools)})
    first, second, third = (s["extras"]["tools"] for s in rec.steps())
    assert first == tools and second is first and third is first


def test_an_answer_carries_the_prompt_ids_text_as_it_came_once_read_as_ids() -> None:
    import orjson
    import pytest

    from rollout_gateway.server.recording.prompt_ids import answer_ids, split_prompt_ids

    raw = b'{"choices":[],"prompt_token_ids":[1, 2,3]}'
    _, text = split_prompt_ids(raw)
    assert text is not None and bytes(text) == b"[1, 2,3]"  # a view, not a copy
    assert orjson.dumps({"prompt_token_ids": answer_ids(text, True)}) == (
        b'{"prompt_token_ids":[1, 2,3]}'
    )
    assert answer_ids(text, False) == [1, 2, 3]  # not read as ids: parsed (or refused)
    with pytest.raises(orjson.JSONDecodeError):
        answer_ids(memoryview(b"[1, x]"), False)
