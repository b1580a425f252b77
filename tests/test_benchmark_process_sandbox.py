"""``benchmarks/process_sandbox.py``: the benchmark's sandbox client really runs commands.

Commands and background jobs run as real processes in the sandbox's directory, with
the request's environment; their exit codes and output come back; a command past its
timeout is killed; deleting a sandbox kills what still runs and removes its files.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("prime_sandboxes")
from prime_sandboxes import CommandTimeoutError, CreateSandboxRequest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from process_sandbox import ProcessSandboxClient  # noqa: E402


def _request(**env: str) -> CreateSandboxRequest:
    return CreateSandboxRequest(name="bench", docker_image="python:3.11-slim", environment_vars=env)


async def test_a_command_runs_in_the_sandbox_with_its_environment(tmp_path: Path) -> None:
    client = ProcessSandboxClient(root=tmp_path)
    sandbox = await client.create(_request(GREETING="hello"))
    await client.wait_for_creation(sandbox.id)
    script = 'mkdir sub && echo "$GREETING from $(pwd)"; echo oops >&2; exit 3'
    done = await client.execute_command(sandbox.id, script)
    assert done.exit_code == 3
    assert done.stdout == f"hello from {tmp_path / sandbox.id}\n"
    assert done.stderr == "oops\n"
    inside = await client.execute_command(sandbox.id, "pwd", working_dir="sub")
    assert (inside.exit_code, inside.stdout) == (0, f"{tmp_path / sandbox.id / 'sub'}\n")
    python = await client.execute_command(sandbox.id, "python3 -c 'import sys; print(sys.prefix)'")
    assert python.stdout == f"{sys.prefix}\n"  # the interpreter's directory first on PATH


async def test_a_background_job_is_seen_to_exit_with_its_output(tmp_path: Path) -> None:
    client = ProcessSandboxClient(root=tmp_path)
    sandbox = await client.create(_request())
    job = await client.start_background_job(sandbox.id, "echo started; sleep 2; exit 5")
    assert not (await client.get_background_job(sandbox.id, job)).completed
    for _ in range(600):
        status = await client.get_background_job(sandbox.id, job)
        if status.completed:
            break
        await asyncio.sleep(0.05)
    assert (status.completed, status.exit_code, status.stdout) == (True, 5, "started\n")


async def test_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    client = ProcessSandboxClient(root=tmp_path)
    sandbox = await client.create(_request())
    with pytest.raises(CommandTimeoutError):
        await client.execute_command(sandbox.id, "echo $$ > pid; exec sleep 30", timeout=1)
    pid = int((tmp_path / sandbox.id / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_delete_kills_the_running_job_and_removes_the_sandbox(tmp_path: Path) -> None:
    client = ProcessSandboxClient()
    sandbox = await client.create(_request())
    job = await client.start_background_job(sandbox.id, "sleep 30")
    pid = client._sandboxes[sandbox.id].jobs[job.job_id][1].pid
    await client.delete(sandbox.id)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    assert not (client.root / sandbox.id).exists()
    client.teardown()
    assert not client.root.exists()
