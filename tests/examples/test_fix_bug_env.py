"""Tests of the fix_bug_env example: its tasks, its CLI agent, and its env hooks.

The agent runs for real (``python3 agent.py`` in a local sandbox) against a small
OpenAI-compatible HTTP server on loopback: either canned replies or the scripted demo
model's own completion builder.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prime_sandboxes import CreateSandboxRequest

from rollout_gateway.examples.fix_bug_env import env as env_module
from rollout_gateway.examples.fix_bug_env.env import (
    agent_source,
    bundle_command,
    load_environment,
)
from rollout_gateway.examples.fix_bug_env.tasks import (
    TASKS,
    Task,
    build_dataset,
    script_for,
    task_prompt,
)
from rollout_gateway.local_sandbox import LocalSandboxClient
from rollout_gateway.scripted import build_completion, find_script

TASK_DIR = "fix_bug_task"
Responder = Callable[[dict[str, Any], int], tuple[int, dict[str, Any]]]


class FakeOpenAI:
    """A loopback chat-completions server; ``responder(body, index) -> (status, json)``."""

    def __init__(self, responder: Responder) -> None:
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                fake.requests.append(body)
                status, payload = responder(body, len(fake.requests) - 1)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def completion(message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "test-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    }


def one_tool_call_then_stop(body: dict[str, Any], index: int) -> tuple[int, dict[str, Any]]:
    if index == 0:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "run_shell",
                "arguments": json.dumps({"command": "echo hello-from-tool && echo made > out.txt"}),
            },
        }
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return 200, completion(message, "tool_calls")
    return 200, completion({"role": "assistant", "content": "All done."}, "stop")


def scripted(body: dict[str, Any], index: int) -> tuple[int, dict[str, Any]]:
    return 200, build_completion(body, "scripted")


@pytest.fixture
async def local_sandboxes(tmp_path: Path) -> AsyncIterator[LocalSandboxClient]:
    client = LocalSandboxClient(
        tmp_path / "sandboxes", reap_interval=None, sweep_stale=False, register_atexit=False
    )
    yield client
    client.teardown()


async def task_sandbox(client: LocalSandboxClient, task: Task, extra: dict[str, str]) -> str:
    sandbox = await client.create(CreateSandboxRequest(name=task.task_id, docker_image="x"))
    files = {**task.files, "agent.py": agent_source(), "task.md": task_prompt(task), **extra}
    result = await client.execute_command(sandbox.id, bundle_command(files, TASK_DIR))
    assert result.exit_code == 0, result.stderr
    return sandbox.id


async def run_agent(
    client: LocalSandboxClient, sid: str, base_url: str, **env: str
) -> tuple[int, str, str]:
    agent_env = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "k", "OPENAI_MODEL": "m", **env}
    result = await client.execute_command(
        sid, "python3 agent.py", working_dir=TASK_DIR, env=agent_env, timeout=60
    )
    return result.exit_code, result.stdout, result.stderr


def test_dataset_is_well_formed() -> None:
    ds = build_dataset()
    assert len(ds) == len(TASKS) >= 3
    assert set(ds.column_names) == {"prompt", "info", "answer"}
    for row, task in zip(ds, TASKS, strict=True):
        (message,) = row["prompt"]
        assert message["role"] == "user"
        assert message["content"].rstrip().endswith("</script>")  # script block last
        script = find_script([message])
        assert script == script_for(task) and len(script) == 4
        info = row["info"]
        assert info["task_id"] == task.task_id
        assert {f["path"]: f["content"] for f in info["files"]} == task.files
        assert info["test_command"] == f"python3 {task.test_file}"
        assert row["answer"] == task.fixed_source != task.files[task.buggy_file]
    assert len({t.task_id for t in TASKS}) == len(TASKS)
    assert any("one_of" in t.fix_step for t in TASKS)  # rewards vary at temperature > 0
    assert [r["info"]["task_id"] for r in build_dataset(7)][5:] == ["calc-add", "text-palindrome"]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.task_id)
async def test_scripted_fix_passes_and_wrong_fixes_fail(
    local_sandboxes: LocalSandboxClient, task: Task
) -> None:
    sid = await task_sandbox(local_sandboxes, task, {})
    test = await local_sandboxes.execute_command(sid, task.test_command, working_dir=TASK_DIR)
    assert test.exit_code != 0, "the bug must make the test fail"

    options = task.fix_step.get("one_of", [task.fix_step])
    for i, step in enumerate(options):
        # Each alternative on a fresh copy of the repository.
        copy = await local_sandboxes.execute_command(sid, f"rm -rf try && cp -r {TASK_DIR} try")
        assert copy.exit_code == 0
        command = step["arguments"]["command"]
        applied = await local_sandboxes.execute_command(sid, command, working_dir="try")
        assert applied.exit_code == 0, applied.stderr
        after = await local_sandboxes.execute_command(sid, task.test_command, working_dir="try")
        if i == 0:  # the temperature-0 choice is the right fix
            assert after.exit_code == 0, after.stdout + after.stderr
            fixed = await local_sandboxes.read_file(sid, f"try/{task.buggy_file}")
            assert fixed.content == task.fixed_source
        else:
            assert after.exit_code != 0, f"alternative {i} should not fix {task.task_id}"


async def test_agent_runs_tool_call_and_exits_zero(local_sandboxes: LocalSandboxClient) -> None:
    sid = await task_sandbox(local_sandboxes, TASKS[0], {})
    with FakeOpenAI(one_tool_call_then_stop) as server:
        code, stdout, stderr = await run_agent(local_sandboxes, sid, server.base_url)
    assert code == 0, stderr
    assert (await local_sandboxes.read_file(sid, f"{TASK_DIR}/out.txt")).content == "made\n"
    assert "All done." in stdout

    first, second = server.requests
    assert first["model"] == "m"
    assert [t["function"]["name"] for t in first["tools"]] == ["run_shell"]
    assert first["tools"][0]["function"]["parameters"]["required"] == ["command"]
    assert first["messages"][-1] == {"role": "user", "content": task_prompt(TASKS[0]).strip()}
    tool_message = second["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["tool_call_id"] == "call_1"
    assert "hello-from-tool" in tool_message["content"]
    assert "exit code 0" in tool_message["content"]


async def test_agent_with_scripted_model_fixes_the_bug(local_sandboxes: LocalSandboxClient) -> None:
    task = TASKS[0]
    sid = await task_sandbox(local_sandboxes, task, {})
    with FakeOpenAI(scripted) as server:
        code, stdout, stderr = await run_agent(local_sandboxes, sid, server.base_url)
    assert code == 0, stderr
    assert len(server.requests) == 4  # cat, fix, test, final answer
    assert "all tests passed" in stdout
    test = await local_sandboxes.execute_command(sid, task.test_command, working_dir=TASK_DIR)
    assert test.exit_code == 0


async def test_agent_turn_limit_and_failures(local_sandboxes: LocalSandboxClient) -> None:
    def always_tool(body: dict[str, Any], index: int) -> tuple[int, dict[str, Any]]:
        return one_tool_call_then_stop(body, 0)

    def rejects(body: dict[str, Any], index: int) -> tuple[int, dict[str, Any]]:
        return 400, {"error": {"message": "bad request", "type": "invalid_request_error"}}

    def closed(body: dict[str, Any], index: int) -> tuple[int, dict[str, Any]]:
        return 409, {"error": {"message": "rollout at max_turns", "type": "conflict"}}

    sids = [await task_sandbox(local_sandboxes, TASKS[0], {}) for _ in range(3)]
    with FakeOpenAI(always_tool) as s1, FakeOpenAI(rejects) as s2, FakeOpenAI(closed) as s3:
        # Concurrently: each run pays the openai import once.
        limited, rejected, ended = await asyncio.gather(
            run_agent(local_sandboxes, sids[0], s1.base_url, AGENT_MAX_TURNS="2"),
            run_agent(local_sandboxes, sids[1], s2.base_url),
            run_agent(local_sandboxes, sids[2], s3.base_url),
        )
    assert limited[0] == 0 and "AGENT_MAX_TURNS=2" in limited[2]
    assert len(s1.requests) == 2
    assert rejected[0] == 1 and "model request failed" in rejected[2]
    assert ended[0] == 0 and "server ended the conversation" in ended[2]

    await local_sandboxes.execute_command(sids[0], f"rm {TASK_DIR}/task.md")
    code, _, stderr = await run_agent(local_sandboxes, sids[0], "http://127.0.0.1:9/v1")
    assert code == 2 and "no task" in stderr


async def test_env_hooks_on_local_backend(tmp_path: Path) -> None:
    env = load_environment(
        use_gateway=False, sandbox_backend="local", local_sandbox_root=str(tmp_path / "env")
    )
    client = env.sandbox_client
    assert isinstance(client, LocalSandboxClient)
    assert env.use_gateway is False
    try:
        row = env.get_dataset()[0]
        task = TASKS[0]
        created = await client.create(CreateSandboxRequest(name="t", docker_image="x"))
        state: dict[str, Any] = {"sandbox_id": created.id, "info": row["info"]}
        state["prompt"] = row["prompt"]
        await env.post_sandbox_setup(state)
        md = await client.read_file(created.id, f"{env.task_dir}/task.md")
        assert md.content == task_prompt(task)
        agent = await client.read_file(created.id, f"{env.task_dir}/agent.py")
        assert agent.content == agent_source()

        await env.post_rollout(state)
        assert state["tests_passed"] is False
        assert await env_module.tests_passed(state) == 0.0

        fix = task.fix_step["arguments"]["command"]
        await client.execute_command(created.id, fix, working_dir=env.task_dir)
        await env.post_rollout(state)
        assert state["tests_passed"] is True and "all tests passed" in state["test_output"]
        assert await env_module.tests_passed(state) == 1.0
    finally:
        client.teardown()
    gateway_env = load_environment(sandbox_backend="local", local_sandbox_root=str(tmp_path))
    try:
        assert gateway_env.use_gateway is True
    finally:
        gateway_env.sandbox_client.teardown()


async def test_gateway_rollouts_end_to_end_on_local_backend(tmp_path: Path) -> None:
    """FixBugEnv in gateway mode: reference gateway + scripted model + real agent.py."""
    import verifiers as vf
    from openai import AsyncOpenAI

    from rollout_gateway.polling import PollPolicy
    from rollout_gateway.scripted import create_scripted_model_app
    from rollout_gateway.server import GatewayConfig, create_app, running_server

    async with running_server(create_scripted_model_app()) as model_root:
        config = GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token="example-admin-token")
        async with running_server(create_app(config)) as gateway_root:
            env = load_environment(
                gateway_admin_token="example-admin-token",
                num_examples=2,
                sandbox_backend="local",
                local_sandbox_root=str(tmp_path / "sb"),
                poll_policy=PollPolicy(min_interval=0.01, max_interval=0.05),
                sandbox_creations_per_minute=None,
            )
            client = vf.OpenAIChatCompletionsClient(
                AsyncOpenAI(base_url=f"{gateway_root}/v1", api_key="unused")
            )
            rows = [{**row, "example_id": i} for i, row in enumerate(env.get_dataset())]
            try:
                states = await asyncio.gather(
                    *(env.rollout(row, client, "scripted", {"temperature": 0}) for row in rows)
                )
                for state in states:
                    await env.rubric.score_rollout(state)
            finally:
                await env._teardown()

    for state in states:
        assert state["error"] is None, state["error"]
        assert state["agent_exit_code"] == 0, state.get("agent_stderr")
        assert state["tests_passed"] is True and state["reward"] == 1.0
        assert len(state["trajectory"]) == 4  # cat, fix, test, final answer
        assert state["trajectory"][0]["tokens"]["completion_ids"]
    assert list((tmp_path / "sb").iterdir()) == []  # sandboxes deleted after scoring
