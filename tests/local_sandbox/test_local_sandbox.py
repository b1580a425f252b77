"""Tests of the local sandbox backend: API parity, isolation, lifetimes and cleanup."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
from helpers import cli_agent_env_request
from prime_sandboxes import (
    AdvancedConfigs,
    APIError,
    BackgroundJob,
    BackgroundJobStatus,
    CommandResponse,
    CommandTimeoutError,
    CreateSandboxRequest,
    ReadFileResponse,
    Sandbox,
    SandboxFileNotFoundError,
    SandboxImagePullError,
    SandboxNotRunningError,
    SandboxTimeoutError,
)

from rollout_gateway.local_sandbox import ROOT_ENV_VAR, IsolationMode, LocalSandboxClient

from .conftest import FakeClock, make_client
from .procs import assert_none_running, markers, wait_running


def request(**overrides: object) -> CreateSandboxRequest:
    fields: dict[str, object] = {"name": "test", "docker_image": "python:3.11-slim"}
    fields.update(overrides)
    return CreateSandboxRequest(**fields)  # type: ignore[arg-type]


async def new_sandbox(client: LocalSandboxClient, **overrides: object) -> str:
    sandbox = await client.create(request(**overrides))
    await client.wait_for_creation(sandbox.id, max_attempts=5)
    return sandbox.id


async def wait_done(
    client: LocalSandboxClient, sid: str, job: BackgroundJob
) -> BackgroundJobStatus:
    for _ in range(500):
        status = await client.get_background_job(sid, job)
        if status.completed:
            return status
        await asyncio.sleep(0.01)
    raise AssertionError("job did not complete")


def _reachable(path: str) -> bool:
    """Whether every directory above ``path`` is searchable by others."""
    return all(os.stat(p).st_mode & 0o001 for p in Path(os.path.realpath(path)).parents)


async def test_request_built_like_cli_agent_env_is_accepted(client: LocalSandboxClient) -> None:
    req = cli_agent_env_request(
        name="rollout_1234abcd",
        timeout_minutes=61,
        environment_vars={"OPENAI_BASE_URL": "http://127.0.0.1:1/v1", "OPENAI_API_KEY": "k"},
        advanced_configs=AdvancedConfigs(),
        labels=["fix-bug"],
    )
    sandbox = await client.create(req)
    assert isinstance(sandbox, Sandbox)
    assert sandbox.status == "RUNNING"
    assert sandbox.name == "rollout_1234abcd"
    assert sandbox.labels == ["fix-bug"]
    await client.wait_for_creation(sandbox.id, max_attempts=120)
    result = await client.execute_command(sandbox.id, 'echo "$OPENAI_BASE_URL"')
    assert result.stdout.strip() == "http://127.0.0.1:1/v1"


async def test_execute_command_output_exit_code_and_cwd(client: LocalSandboxClient) -> None:
    sid = await new_sandbox(client)
    result = await client.execute_command(sid, "echo out; echo err >&2; pwd; exit 4")
    assert isinstance(result, CommandResponse)
    assert result.exit_code == 4
    assert result.stderr == "err\n"
    out_lines = result.stdout.splitlines()
    assert out_lines[0] == "out"
    assert out_lines[1] == str(client.root / sid / "work")

    await client.execute_command(sid, "mkdir -p sub && echo hi > sub/f.txt")
    in_sub = await client.execute_command(sid, "cat f.txt", working_dir="sub")
    assert in_sub.stdout == "hi\n"
    missing = await client.execute_command(sid, "echo never", working_dir="nope")
    assert missing.exit_code != 0 and "never" not in missing.stdout

    env = await client.execute_command(sid, 'echo "$FOO-$HOME"', env={"FOO": "bar"})
    assert env.stdout.strip() == f"bar-{client.root / sid / 'work'}"
    with pytest.raises(ValueError):
        await client.execute_command(sid, "true", env={"BAD-KEY": "x"})


async def test_python_is_current_interpreter(client: LocalSandboxClient) -> None:
    if client.isolation in (IsolationMode.UNSHARE, IsolationMode.UID) and not _reachable(
        sys.executable
    ):
        pytest.skip(f"{sys.executable} is not reachable by an unprivileged uid on this host")
    sid = await new_sandbox(client)
    result = await client.execute_command(
        sid, "python3 -c 'import sys; print(sys.prefix)'; command -v python3"
    )
    assert result.exit_code == 0, result.stderr
    prefix, path = result.stdout.split()
    assert prefix == sys.prefix
    assert os.path.dirname(path) == os.path.dirname(sys.executable)


async def test_files_upload_read_download(client: LocalSandboxClient, tmp_path: Path) -> None:
    sid = await new_sandbox(client)
    local = tmp_path / "local.txt"
    local.write_text("from host\n")
    up = await client.upload_file(sid, "dir/a.txt", str(local))
    assert up.success and up.size == len("from host\n")
    await client.upload_bytes(sid, "b.bin", b"bytes!", "b.bin")
    assert (await client.execute_command(sid, "cat dir/a.txt b.bin")).stdout == "from host\nbytes!"

    read = await client.read_file(sid, "dir/a.txt")
    assert isinstance(read, ReadFileResponse)
    assert read.content == "from host\n" and read.size == 10
    window = await client.read_file(sid, "dir/a.txt", offset=5, length=4)
    assert window.content == "host" and window.truncated is True and window.total_size == 10
    # An absolute path inside the sandbox is fine too.
    absolute = await client.read_file(sid, str(client.root / sid / "work" / "b.bin"))
    assert absolute.content == "bytes!"

    await client.download_file(sid, "b.bin", str(tmp_path / "out" / "b.bin"))
    assert (tmp_path / "out" / "b.bin").read_bytes() == b"bytes!"

    with pytest.raises(SandboxFileNotFoundError):
        await client.read_file(sid, "missing.txt")
    with pytest.raises(FileNotFoundError):
        await client.upload_file(sid, "x", str(tmp_path / "nope"))
    # The file API never touches host paths outside the sandbox.
    escape = str(tmp_path / "escape.txt")
    if client.isolation is IsolationMode.BWRAP:
        # In bwrap mode /tmp is the sandbox's own temp directory, for its file API as for
        # its processes: a /tmp path lands there, never on the host's /tmp.
        await client.upload_bytes(sid, escape, b"x", "escape.txt")
        assert (await client.execute_command(sid, f"cat {escape}")).stdout == "x"
    else:
        with pytest.raises(APIError):
            await client.upload_bytes(sid, escape, b"x", "escape.txt")
    with pytest.raises(APIError):
        await client.read_file(sid, "../../escape.txt")
    assert not (tmp_path / "escape.txt").exists()


async def test_background_job_lifecycle(client: LocalSandboxClient) -> None:
    sid = await new_sandbox(client)
    job = await client.start_background_job(
        sid, 'sleep 0.2; echo "$X"; echo oops >&2; exit 3', env={"X": "value"}
    )
    assert job.sandbox_id == sid
    first = await client.get_background_job(sid, job)
    assert first.completed is False and first.exit_code is None
    status = await wait_done(client, sid, job)
    assert (status.exit_code, status.stdout, status.stderr) == (3, "value\n", "oops\n")
    # Polling a finished job again is stable, and its logs stay readable.
    assert await client.get_background_job(sid, job) == status
    assert (await client.read_file(sid, job.exit_file)).content.strip() == "3"

    done = await client.run_background_job(sid, "echo quick", timeout=10, poll_interval=1)
    assert done.completed and done.exit_code == 0 and done.stdout == "quick\n"
    with pytest.raises(CommandTimeoutError):
        await client.run_background_job(sid, "sleep 5", timeout=1, poll_interval=1)


async def test_sandboxes_are_isolated(client: LocalSandboxClient) -> None:
    a = await new_sandbox(client)
    b = await new_sandbox(client)
    await client.execute_command(a, "echo secret-a > mine.txt")
    await client.execute_command(b, "mkdir keep && echo keep-b > keep/data.txt")

    seen = await client.execute_command(b, "ls -A; cat mine.txt")
    assert "mine.txt" not in seen.stdout and seen.exit_code != 0
    with pytest.raises(SandboxFileNotFoundError):
        await client.read_file(b, "mine.txt")

    # A destructive agent in `a` wipes its own working dir only.
    wipe = await client.execute_command(a, 'rm -rf ./* ./.[!.]* "$HOME"/*; ls -A')
    assert wipe.stdout == ""
    assert (await client.read_file(b, "keep/data.txt")).content == "keep-b\n"


async def test_host_environment_does_not_leak(
    client: LocalSandboxClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_SECRET_API_KEY", "sk-host-secret-123")
    sid = await new_sandbox(client, environment_vars={"GIVEN": "yes"}, secrets={"TOKEN": "t"})
    result = await client.execute_command(sid, "env")
    assert "sk-host-secret-123" not in result.stdout
    assert "HOST_SECRET_API_KEY" not in result.stdout
    assert "GIVEN=yes" in result.stdout and "TOKEN=t" in result.stdout
    job = await client.start_background_job(sid, "env")
    assert "sk-host-secret-123" not in ((await wait_done(client, sid, job)).stdout or "")


async def test_delete_kills_forever_loop_and_escapees(client: LocalSandboxClient) -> None:
    sid = await new_sandbox(client)
    loop, escaped = markers(2)
    job = await client.start_background_job(
        sid, f"setsid sh -c 'exec sleep {escaped}' & while :; do sleep {loop}; done"
    )
    await wait_running(loop, escaped)

    await client.delete(sid)
    assert_none_running(loop, escaped)
    assert not (client.root / sid).exists()

    # Deleting again is fine; using the sandbox is not.
    await client.delete(sid)
    with pytest.raises(SandboxNotRunningError):
        await client.get_background_job(sid, job)
    with pytest.raises(SandboxNotRunningError):
        await client.execute_command(sid, "true")
    with pytest.raises(APIError):
        await client.delete("local-never-created")


async def test_sandbox_lifetime_is_enforced(client: LocalSandboxClient, clock: FakeClock) -> None:
    reaped = await new_sandbox(client, timeout_minutes=1)
    lazy = await new_sandbox(client, timeout_minutes=1)
    long_lived = await new_sandbox(client, timeout_minutes=10)
    (mark,) = markers(1)
    await client.start_background_job(reaped, f"exec sleep {mark}")
    await wait_running(mark)

    clock.advance(59)
    assert client.reap_expired() == []
    clock.advance(2)
    assert sorted(client.reap_expired()) == sorted([reaped, lazy])
    assert_none_running(mark)
    assert not (client.root / reaped).exists()
    with pytest.raises(SandboxTimeoutError):
        await client.execute_command(reaped, "true")
    assert (await client.execute_command(long_lived, "echo ok")).stdout == "ok\n"

    # Without the reaper, the next call on an expired sandbox notices it.
    other = await new_sandbox(client, timeout_minutes=1)
    clock.advance(61)
    with pytest.raises(SandboxTimeoutError):
        await client.execute_command(other, "true")
    assert not (client.root / other).exists()


async def test_command_timeout_kills_the_command(client: LocalSandboxClient) -> None:
    sid = await new_sandbox(client)
    first, second = markers(2)
    with pytest.raises(CommandTimeoutError):
        await client.execute_command(sid, f"sleep {first}", timeout=1)
    assert_none_running(first)
    # A cancelled call does not leave its command running either.
    task = asyncio.create_task(client.execute_command(sid, f"sleep {second}"))
    await wait_running(second)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_none_running(second)


async def test_teardown_leaves_nothing_behind(client: LocalSandboxClient) -> None:
    marks = markers(3)
    for mark in marks:
        sid = await new_sandbox(client)
        await client.start_background_job(sid, f"sleep {mark} & wait")
    await wait_running(*marks)
    client.teardown()
    assert_none_running(*marks)
    assert list(client.root.iterdir()) == []
    client.teardown()  # idempotent


async def test_bulk_delete_by_ids_and_labels(client: LocalSandboxClient) -> None:
    a = await new_sandbox(client, labels=["x", "y"])
    b = await new_sandbox(client, labels=["x"])
    c = await new_sandbox(client, labels=["z"])
    res = await client.bulk_delete(labels=["x"])
    assert sorted(res.succeeded) == sorted([a, b]) and res.failed == []
    res = await client.bulk_delete(sandbox_ids=[c, "local-unknown"])
    assert res.succeeded == [c] and res.failed[0]["sandbox_id"] == "local-unknown"
    assert list(client.root.iterdir()) == []


async def test_local_image_seeding(client: LocalSandboxClient, tmp_path: Path) -> None:
    src = tmp_path / "image"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    sid = await new_sandbox(client, docker_image=f"local:{src}")
    assert (await client.read_file(sid, "pkg/mod.py")).content == "X = 1\n"
    sid_abs = await new_sandbox(client, docker_image=str(src))
    assert (await client.read_file(sid_abs, "pkg/mod.py")).content == "X = 1\n"

    archive = tmp_path / "image.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"from tar\n"
        info = tarfile.TarInfo("seed.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    sid_tar = await new_sandbox(client, docker_image=f"dir:{archive}")
    assert (await client.read_file(sid_tar, "seed.txt")).content == "from tar\n"

    bad = await client.create(request(docker_image=f"local:{tmp_path / 'missing'}"))
    assert bad.status == "ERROR"
    with pytest.raises(SandboxImagePullError):
        await client.wait_for_creation(bad.id)


async def test_file_size_limit_applies(client: LocalSandboxClient) -> None:
    sid = await new_sandbox(client, disk_size_gb=1 / 1024**2)  # 1 KiB per file
    result = await client.execute_command(sid, "head -c 4096 /dev/zero > big; echo rc=$?")
    assert "rc=0" not in result.stdout
    assert (client.root / sid / "work" / "big").stat().st_size <= 1024


async def test_main_start_command_runs_and_is_killed(client: LocalSandboxClient) -> None:
    (mark,) = markers(1)
    sid = await new_sandbox(client, vm=False, start_command=f"exec sleep {mark}")
    await wait_running(mark)
    await client.delete(sid)
    assert_none_running(mark)


def test_root_from_env(monkeypatch: pytest.MonkeyPatch, root: Path, mode: IsolationMode) -> None:
    monkeypatch.setenv(ROOT_ENV_VAR, str(root))
    client = LocalSandboxClient(isolation=mode, reap_interval=None, register_atexit=False)
    try:
        assert client.root == root.resolve()
    finally:
        client.teardown()


async def test_reaper_thread_expires_sandboxes(root: Path, mode: IsolationMode) -> None:
    clock = FakeClock()
    client = make_client(root, mode, clock=clock, reap_interval=0.02)
    try:
        sid = await new_sandbox(client, timeout_minutes=1)
        clock.advance(120)
        for _ in range(200):
            if not (root / sid).exists():
                break
            await asyncio.sleep(0.01)
        assert not (root / sid).exists()
        with pytest.raises(SandboxTimeoutError):
            await client.read_file(sid, "x")
    finally:
        client.teardown()


def _reapers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "local-sandbox-reaper"}


async def test_teardown_waits_for_the_reaper_thread(root: Path, mode: IsolationMode) -> None:
    # A reaper caught mid-pass (its clock call takes a while) must have ended when
    # teardown(wait=True) returns: it is joined, not only told to stop.
    in_pass = threading.Event()

    def clock() -> float:
        if threading.current_thread().name == "local-sandbox-reaper":
            in_pass.set()
            time.sleep(0.3)
        return 0.0

    client = make_client(root, mode, clock=clock, reap_interval=0.01)
    before = _reapers()
    await new_sandbox(client)  # the first sandbox starts the reaper
    started = _reapers() - before
    assert len(started) == 1
    assert await asyncio.to_thread(in_pass.wait, 5)
    client.teardown(wait=True)
    assert not any(thread.is_alive() for thread in started)
