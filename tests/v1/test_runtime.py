"""The ``local_sandbox`` runtime type: v1's ``Runtime`` contract on the local sandboxes,
selected from config and the CLI, running the example agent through the gateway."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarnessConfig, FixBugTaskset
from local_sandbox.procs import assert_none_running, markers, wait_running
from pydantic import ValidationError
from verifiers.v1 import runtimes as v1_runtimes
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime, make_runtime
from verifiers.v1.utils.loaders import resolve_env_config

from rollout_gateway import child_processes
from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import (
    GatewayEnvConfig,
    LocalSandboxAgentConfig,
    LocalSandboxRuntime,
    LocalSandboxRuntimeConfig,
    LocalSandboxStartError,
    RuntimeChoice,
    check_local_sandbox,
    gateway_synced_agent,
)

from .conftest import ADMIN_TOKEN, Stack


def _mode(mode: IsolationMode) -> str:
    reason = unavailable_reasons()[mode]
    if reason is not None:
        pytest.skip(f"isolation {mode} unavailable here: {reason}")
    return str(mode)


@pytest.fixture(params=list(IsolationMode), ids=str)
def isolation(request: pytest.FixtureRequest, sandbox_root: Path) -> str:
    return _mode(request.param)


@pytest.fixture
def sandbox_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root every sandbox uid can traverse (pytest's tmp dir may be under a 0700 home)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="rg-v1-sandboxes-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path / "sandboxes"
    shutil.rmtree(path, ignore_errors=True)


def runtime_config(root: Path, isolation: str, **overrides: Any) -> LocalSandboxRuntimeConfig:
    return LocalSandboxRuntimeConfig(isolation=isolation, root=str(root), **overrides)  # type: ignore[arg-type]


# ---------------------------------------------------------------- selection


def test_env_config_selects_local_sandbox_by_type() -> None:
    config = resolve_env_config(
        {
            "taskset": {"id": "fix-bug-v1"},
            "agent": {"runtime": {"type": "local_sandbox", "isolation": "bwrap", "pids": 64}},
        }
    )
    assert isinstance(config, GatewayEnvConfig)
    runtime = config.agent.runtime
    assert isinstance(runtime, LocalSandboxRuntimeConfig)
    assert (runtime.isolation, runtime.pids) == ("bwrap", 64)
    # v1's own types still validate.
    plain = resolve_env_config(
        {"taskset": {"id": "fix-bug-v1"}, "agent": {"runtime": {"type": "subprocess"}}}
    )
    assert isinstance(plain.agent.runtime, SubprocessConfig)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "local_sandbox", "isolation": "chroot"},
        {"type": "local_sandbox", "memory": 0},
        {"type": "local_sandbox", "pids": -1},
        {"type": "local_sandbox", "image": "python:3.11-slim"},
        {"type": "local_sandbox", "unknown": 1},
    ],
)
def test_bad_local_sandbox_options_are_refused_at_config_time(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        resolve_env_config({"taskset": {"id": "fix-bug-v1"}, "agent": {"runtime": bad}})


def test_runtime_choice_is_v1s_union_plus_local_sandbox() -> None:
    """A verifiers upgrade that adds a runtime type must be seen here (the choice is
    written out, as v1's own union is)."""
    ours = set(typing.get_args(typing.get_args(RuntimeChoice)[0]))
    v1s = set(typing.get_args(typing.get_args(v1_runtimes.RuntimeConfig)[0]))
    assert ours == v1s | {LocalSandboxRuntimeConfig}


def test_v1s_runtime_table_resolves_local_sandbox_and_nothing_else_changes(
    sandbox_root: Path,
) -> None:
    config = runtime_config(sandbox_root, "auto")
    assert v1_runtimes.runtime_is_local(config)
    assert isinstance(make_runtime(config), LocalSandboxRuntime)
    assert isinstance(make_runtime(SubprocessConfig()), SubprocessRuntime)
    # Every one of v1's own types resolves to v1's runtime of that name, as before.
    for config_cls in typing.get_args(typing.get_args(v1_runtimes.RuntimeConfig)[0]):
        config = config_cls()
        runtime_cls = v1_runtimes._runtime_cls(config)
        assert runtime_cls.__module__.startswith("verifiers.v1.runtimes.")
        assert runtime_cls.__name__.lower() == f"{config.type}runtime"


# ---------------------------------------------------------------- the contract


async def test_runtime_contract(sandbox_root: Path, isolation: str) -> None:
    runtime = make_runtime(runtime_config(sandbox_root, isolation))
    assert isinstance(runtime, LocalSandboxRuntime)
    runtime.env = {"TASK_VAR": "task"}
    await runtime.start()
    try:
        workdir = runtime.workdir
        assert workdir is not None and workdir.is_dir()
        result = await runtime.run(
            ["sh", "-c", 'echo "$TASK_VAR $CALL_VAR $HOME"; pwd; echo oops >&2; exit 3'],
            {"CALL_VAR": "call"},
        )
        assert result.exit_code == 3
        assert result.stdout.splitlines() == [f"task call {workdir}", str(workdir)]
        assert result.stderr == "oops\n"
        # Files: relative paths in the working directory, bytes exact, reads capped.
        payload = bytes(range(256)) * 4
        await runtime.write("dir/data.bin", payload)
        assert await runtime.read("dir/data.bin") == payload
        assert await runtime.read(f"{workdir}/dir/data.bin", max_bytes=len(payload)) == payload
        with pytest.raises(SandboxError, match="over the 10 byte limit"):
            await runtime.read("dir/data.bin", max_bytes=10)
        assert (await runtime.run(["cat", "dir/data.bin"], {})).stdout.encode("latin-1", "replace")[
            :4
        ] == payload[:4]
        with pytest.raises(FileNotFoundError):
            await runtime.read("missing.txt")
        with pytest.raises(SandboxError):
            await runtime.write("/etc/rollout-gateway-test", b"x")
        # The interpreter the harnesses use, with its packages.
        result = await runtime.run(
            [sys.executable, "-c", "import openai, sys; print(sys.prefix)"], {}
        )
        assert (result.exit_code, result.stdout.strip()) == (0, sys.prefix), result.stderr
        # A live process: stdin in, stdout and stderr out, its exit code.
        process = await runtime.open_process(
            ["sh", "-c", 'read line; echo "got $line"; echo done >&2; exit 5'], {}
        )
        await process.write(b"hello\n")
        out = b"".join([chunk async for chunk in process.stdout])
        err = b"".join([chunk async for chunk in process.stderr])
        assert (out, err, await process.wait()) == (b"got hello\n", b"done\n", 5)
        # A background process keeps running until the runtime stops.
        await runtime.run_background(["sh", "-c", "echo started; exec sleep 1000"], {}, "bg.log")
        for _ in range(200):
            if (workdir / "bg.log").exists() and (workdir / "bg.log").read_bytes():
                break
            await asyncio.sleep(0.02)
        assert await runtime.read("bg.log") == b"started\n"
        assert await runtime.alive()
    finally:
        await runtime.stop()
    assert not workdir.exists()
    assert not await runtime.alive()


async def test_cancelled_run_kills_the_command(sandbox_root: Path, isolation: str) -> None:
    runtime = make_runtime(runtime_config(sandbox_root, isolation))
    await runtime.start()
    (mark,) = markers(1)
    try:
        task = asyncio.ensure_future(runtime.run(["sh", "-c", f"sleep {mark}; echo no"], {}))
        await wait_running(mark)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_none_running(mark)
        assert (await runtime.run(["echo", "still usable"], {})).stdout == "still usable\n"
    finally:
        await runtime.stop()


async def test_unavailable_mode_is_a_typed_error_before_any_rollout(sandbox_root: Path) -> None:
    unavailable = [m for m, why in unavailable_reasons().items() if why is not None]
    if not unavailable:
        pytest.skip("every isolation mode is available here")
    config = runtime_config(sandbox_root, str(unavailable[0]))
    with pytest.raises(LocalSandboxStartError, match=f"isolation {unavailable[0]}"):
        await check_local_sandbox(config)
    runtime = make_runtime(config)
    with pytest.raises(LocalSandboxStartError):
        await runtime.start()
    await runtime.stop()  # safe after a failed start


async def test_unwritable_root_is_a_typed_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = LocalSandboxRuntimeConfig(isolation="process-group", root=str(blocker / "root"))
    with pytest.raises(LocalSandboxStartError, match="choose another root"):
        await check_local_sandbox(config)


async def test_vf_eval_with_sandboxes_this_host_cannot_run_stops_before_any_rollout(
    stack: Stack, tmp_path: Path
) -> None:
    """The env checks its sandboxes when it starts serving: one error naming the mode and
    what to do, no rollout run, nothing registered at the gateway."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN, "NO_COLOR": "1"}
    process = await child_processes.spawn_async(  # dies with this process
        str(bin_dir / "vf-eval"),
        "fix-bug-v1",
        "-m",
        "scripted",
        "--client.base-url",
        f"{stack.gateway_url}/v1",
        "--env.agent.runtime.type",
        "local_sandbox",
        "--env.agent.runtime.root",
        str(blocker / "root"),
        "--env.interception.type",
        "gateway",
        "--env.interception.tunnel",
        "direct",
        "--no-push",
        "--no-rich",
        "-o",
        str(tmp_path / "runs"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=240)
    text = output.decode()
    assert process.returncode != 0, text[-3000:]
    assert "LocalSandboxStartError" in text and "choose another root" in text, text[-3000:]
    rows = [
        line
        for p in (tmp_path / "runs").rglob("traces.jsonl")
        for line in p.read_text().splitlines()
    ]
    assert rows == []
    assert stack.gateway.metrics.registrations.value() == 0


# ---------------------------------------------------------------- a real agent


async def test_example_agent_runs_contained_through_the_gateway(
    stack: Stack, make_interception: Any, sandbox_root: Path
) -> None:
    mode = _mode(IsolationMode.BWRAP)
    interception, _ = await make_interception()
    config = LocalSandboxAgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=f"{stack.gateway_url}/v1"),
        harness=FixBugHarnessConfig(),
        runtime=runtime_config(sandbox_root, mode),
    )
    agent = gateway_synced_agent(vf.Agent(config, interception=interception), interception)
    task = next(iter(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1"))))
    async with agent:
        trace = await agent.run(task)
    assert trace.ok and trace.stop_condition == "agent_completed", trace.errors
    assert trace.rewards["tests_pass"].score == 1.0
    assert trace.num_turns == 4
    assert trace.agent.runtime.type == "local_sandbox"
    assert trace.agent.runtime.isolation == mode
    assert trace.agent.runtime.id.startswith("local-")
    assert not (sandbox_root / trace.agent.runtime.id).exists()  # removed with the rollout
    assert len(stack.gateway.registry) == 0


async def _run(*argv: str, env: dict[str, str], cwd: Path | None = None) -> str:
    process = await child_processes.spawn_async(  # dies with this process
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=cwd
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=240)
    text = output.decode()
    assert process.returncode == 0, text[-3000:]
    return text


def _episodes(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "traces.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


async def test_vf_eval_selects_local_sandbox_from_the_cli_and_vf_replay_and_resume_read_the_run(
    stack: Stack, tmp_path: Path, sandbox_root: Path
) -> None:
    """The run directory of a local-sandbox run is v1's own: ``vf-replay`` re-scores it and
    ``vf-eval --resume`` keeps its finished rollouts (v1 parses every trace)."""
    mode = _mode(IsolationMode.BWRAP)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN, "NO_COLOR": "1"}
    output = await _run(
        str(bin_dir / "vf-eval"),
        "fix-bug-v1",
        "-m",
        "scripted",
        "--client.base-url",
        f"{stack.gateway_url}/v1",
        "--env.agent.runtime.type",
        "local_sandbox",
        "--env.agent.runtime.isolation",
        mode,
        "--env.agent.runtime.root",
        str(sandbox_root),
        "--env.interception.type",
        "gateway",
        "--env.interception.tunnel",
        "direct",
        "--no-push",
        "-n",
        "2",
        "-o",
        str(tmp_path / "runs"),
        env=env,
    )
    assert "serializer warnings" not in output and "SerializationUnexpected" not in output
    (traces_file,) = (tmp_path / "runs").rglob("traces.jsonl")
    run_dir = traces_file.parent
    episodes = _episodes(run_dir)
    assert len(episodes) == 2
    for episode in episodes:
        (trace,) = episode["traces"]
        assert episode["ok"] and trace["stop_condition"] == "agent_completed"
        assert trace["rewards"]["tests_pass"]["score"] == 1.0
        pass
        record = trace["info"]["local_sandbox"]
        assert (record["type"], record["isolation"]) == ("local_sandbox", mode)
        assert record["id"] == trace["agent"]["runtime"]["id"]
    assert list(sandbox_root.iterdir()) == []  # every sandbox removed
    (saved,) = (run_dir / "configs" / "resolved").glob("*.json")
    assert json.loads(saved.read_text())["env"]["agent"]["runtime"]["type"] == "local_sandbox"

    # vf-replay re-scores every trace of the run
    replay_out = tmp_path / "replay"
    await _run(
        str(bin_dir / "vf-replay"), str(run_dir), "-o", str(replay_out), "--no-rich", env=env
    )
    replayed = _episodes(replay_out)
    assert len(replayed) == 2
    assert {e["traces"][0]["info"]["local_sandbox"]["id"] for e in replayed} == {
        e["traces"][0]["info"]["local_sandbox"]["id"] for e in episodes
    }

    # vf-eval --resume: a run cut short after one rollout runs only the other, contained
    lines = traces_file.read_text().splitlines(keepends=True)
    traces_file.write_text(lines[0])
    resume_args = (str(bin_dir / "vf-eval"), "@", str(saved), "--resume")
    output = await _run(*resume_args, env=env)
    resumed = _episodes(run_dir)
    assert len(resumed) == 2, output[-2000:]
    assert traces_file.read_text().startswith(lines[0])  # the finished one kept as it was
    assert resumed[1]["traces"][0]["info"]["local_sandbox"]["isolation"] == mode
    assert resumed[1]["ok"]
    output = await _run(*resume_args, env=env)
    assert "nothing to resume" in output
    assert list(sandbox_root.iterdir()) == []
