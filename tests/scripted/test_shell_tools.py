"""The scripted model's ``run_shell`` steps drive each agent's own shell tool."""

from __future__ import annotations

import json

from rollout_gateway.scripted.app import build_completion
from rollout_gateway.scripted.policy import decide

SCRIPT = (
    '<script>[{"tool": "run_shell", "arguments": {"command": "echo hi > out.txt"}}, '
    '{"tool": "Read", "arguments": {"file_path": "out.txt"}}, {"say": "Done."}]</script> Fix it'
)


def function_tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def first_call(tools: list[dict] | None) -> tuple[str, dict]:
    action = decide([{"role": "user", "content": SCRIPT}], tools=tools)
    [call] = action.tool_calls
    return call.name, json.loads(call.arguments)


def test_claude_codes_bash_gets_the_command():
    tools = [function_tool(n) for n in ("Agent", "Bash", "Edit", "Read")]
    assert first_call(tools) == ("Bash", {"command": "echo hi > out.txt"})


def test_codexs_exec_command_gets_it_as_cmd():
    tools = [function_tool("exec_command"), function_tool("write_stdin")]
    assert first_call(tools) == ("exec_command", {"cmd": "echo hi > out.txt"})


def test_an_agent_offering_run_shell_or_no_known_shell_tool_gets_the_step_as_written():
    as_written = ("run_shell", {"command": "echo hi > out.txt"})
    assert first_call([function_tool("run_shell"), function_tool("Bash")]) == as_written
    assert first_call([function_tool("search")]) == as_written
    assert first_call(None) == as_written


def test_other_tools_are_called_by_their_own_names():
    messages = [
        {"role": "user", "content": SCRIPT},
        {"role": "assistant", "content": None},
    ]
    action = decide(messages, tools=[function_tool("Bash"), function_tool("Read")])
    assert [(c.name, json.loads(c.arguments)) for c in action.tool_calls] == [
        ("Read", {"file_path": "out.txt"})
    ]


def test_the_served_completion_calls_the_requests_shell_tool():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": SCRIPT}],
        "tools": [function_tool("exec_command")],
    }
    [call] = build_completion(body, "m")["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "exec_command"
    assert json.loads(call["function"]["arguments"]) == {"cmd": "echo hi > out.txt"}
