"""Resource limits and stops: a fork bomb, a disk fill, a memory hog and a SIGTERM-ignoring
agent are each stopped at their limit while a sibling sandbox keeps working, in every
isolation mode this host offers (tiny limits: fast and safe on a shared machine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prime_sandboxes import BackgroundJob, CreateSandboxRequest

from rollout_gateway.local_sandbox import IsolationMode, LocalSandboxClient, cgroups, disks

from .conftest import ALL_MODES, make_client, require_mode
from .procs import assert_none_running, markers, wait_running

MiB = 1024 * 1024


@pytest.fixture(params=ALL_MODES, ids=str)
async def client(request: pytest.FixtureRequest, root: Path):
    mode = require_mode(request.param)
    c = make_client(root, mode, reap_interval=0.05, pids_limit=32)
    yield c
    c.teardown()


async def new(client: LocalSandboxClient, *, memory_mib: int = 64, disk_mib: int = 32) -> str:
    sandbox = await client.create(
        CreateSandboxRequest(
            name="limits",
            docker_image="x",
            memory_gb=memory_mib / 1024,
            disk_size_gb=disk_mib / 1024,
            labels=[],
        )
    )
    return sandbox.id


async def finished(client: LocalSandboxClient, sid: str, job: BackgroundJob, timeout: float = 60):
    for _ in range(int(timeout / 0.02)):
        status = await client.get_background_job(sid, job)
        if status.completed:
            return status
        await asyncio.sleep(0.02)
    raise AssertionError("job still running")


async def sibling_works(client: LocalSandboxClient, sid: str) -> None:
    result = await client.execute_command(sid, "echo ok > f && cat f")
    assert (result.exit_code, result.stdout) == (0, "ok\n")


def can_enforce_pids(client: LocalSandboxClient) -> bool:
    return cgroups.availability() is None or client.isolation.uses_sandbox_uid


async def test_fork_bomb_is_stopped_at_the_process_limit(client: LocalSandboxClient) -> None:
    if not can_enforce_pids(client):
        pytest.skip(f"no process limit here: {client.limit_enforcement()['processes']}")
    bomb, sibling = await new(client), await new(client)
    job = await client.start_background_job(bomb, "b() { b | b & }; b; sleep 600")
    status = await finished(client, bomb, job)
    assert status.exit_code != 0
    if cgroups.availability() is None:  # the watchdog saw the refused forks
        assert "process limit (32) reached" in (status.stderr or "")
    await sibling_works(client, sibling)
    await client.delete(bomb)
    assert not (client.root / bomb).exists()


async def test_disk_fill_is_stopped_at_the_disk_limit(client: LocalSandboxClient) -> None:
    filler, sibling = await new(client, disk_mib=32), await new(client)
    job = await client.start_background_job(
        filler,
        "for i in 1 2 3 4 5 6 7 8; do head -c 8388608 /dev/zero > f$i; done; sleep 600",
    )
    status = await finished(client, filler, job)
    assert status.exit_code != 0
    assert "disk limit (32 MiB) reached" in (status.stderr or ""), status.stderr
    held = disks.usage_bytes(client.root / filler / "work")
    # Own file system: never past it. Watchdog: at most a few files past it, then stopped.
    assert held <= (32 if disks.availability() is None else 64) * MiB, held
    await sibling_works(client, sibling)


async def test_a_job_the_limit_ended_says_why_when_the_stop_came_after_it(root: Path) -> None:
    """A job the limit ended (its write refused, a fork refused) can exit by itself just
    before the reaper thread stops its sandbox: its status still says why. Driven without
    the thread: the stop runs after the job has exited (the disk watchdog's limit, no
    file system of its own: two files of 24 MiB, each under the per-process file size
    limit, then the job exits 3)."""
    client = make_client(root, IsolationMode.PROCESS_GROUP, enforce_limits=False)
    try:
        sid = await new(client, disk_mib=32)
        fill = 'cd "$HOME"; for i in 1 2; do head -c 25165824 /dev/zero > f$i; done'
        job = await client.start_background_job(sid, f"{fill}; touch ended; exit 3")
        ended = client.root / sid / "work" / "ended"
        for _ in range(3000):
            if ended.exists():
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"the job never wrote {ended}")
        await asyncio.sleep(0.5)  # the job's shell has exited: only the stop is left
        assert client.enforce_limits() == [sid]
        status = await finished(client, sid, job)
        assert status.exit_code == 3
        assert "disk limit (32 MiB) reached" in (status.stderr or ""), status.stderr
    finally:
        client.teardown()


async def test_memory_hog_is_stopped_at_the_memory_limit(client: LocalSandboxClient) -> None:
    hog, sibling = await new(client, memory_mib=64), await new(client)
    grab = f"{sys.executable} -c 'x = bytearray(256 << 20); print(len(x))'"
    result = await client.execute_command(hog, grab, timeout=60)
    assert result.exit_code != 0 and str(256 << 20) not in result.stdout
    await sibling_works(client, sibling)


async def test_tmp_counts_against_the_limits(client: LocalSandboxClient) -> None:
    """/tmp is the sandbox's own temp directory: filling it hits the sandbox's limits."""
    if client.isolation is not IsolationMode.BWRAP:
        pytest.skip("only bwrap mounts the sandbox's own temp directory at /tmp")
    sid = await new(client, memory_mib=64, disk_mib=32)
    result = await client.execute_command(
        sid, "dd if=/dev/zero of=/tmp/fill bs=1M count=256 2>&1; du -m /tmp/fill", timeout=60
    )
    # Either the write stopped at the limit and du reports it, or the watchdog stopped the
    # sandbox first (it races du) and says why: both keep /tmp within the limits.
    sizes = [x for x in result.stdout.splitlines() if x.endswith("/tmp/fill")]
    if sizes:
        assert 0 < int(sizes[0].split()[0]) <= 64, result.stdout
    else:
        assert result.exit_code != 0 and "limit" in result.stderr, result
    fill = client.root / sid / "tmp" / "fill"
    assert not fill.exists() or fill.stat().st_size <= 64 * MiB


async def test_sigterm_ignoring_agent_is_killed_and_its_sandbox_removed(
    client: LocalSandboxClient,
) -> None:
    (mark,) = markers(1)
    sid = await new(client)
    await client.start_background_job(sid, f"trap '' TERM; sleep {mark} & trap '' TERM; wait")
    await wait_running(mark)
    await client.delete(sid)
    assert_none_running(mark)
    assert not (client.root / sid).exists()


async def test_stopping_a_sandbox_stops_every_process_it_runs(client: LocalSandboxClient) -> None:
    """What the classic mixin does to a timed-out agent before scoring: every process goes,
    in every mode (a stop command run inside a namespace mode could not see them)."""
    m1, m2 = markers(2)
    sid = await new(client)
    job = await client.start_background_job(
        sid, f"trap '' TERM; (setsid sleep {m1} &); sleep {m2} & wait"
    )
    await wait_running(m1, m2)
    await asyncio.to_thread(client.stop_processes, sid)
    assert_none_running(m1, m2)
    assert (await finished(client, sid, job)).completed
    await sibling_works(client, sid)  # the sandbox itself stays, for scoring


async def test_limit_enforcement_is_reported(client: LocalSandboxClient) -> None:
    enforced = client.limit_enforcement()
    assert set(enforced) == {"processes", "memory", "disk", "cpu"}
    if cgroups.availability() is None:
        assert "cgroup" in enforced["memory"] and "cgroup" in enforced["processes"]
    if disks.availability() is None:
        assert "file system" in enforced["disk"]


def test_a_crashed_clients_groups_are_swept_wherever_it_made_them(root: Path) -> None:
    """A client in another memory group (as each job of a batch system is) crashes with a
    sandbox: the stale sweep, run from this process's group, removes that sandbox's groups
    and the emptied ``rollout-gateway`` parent it had made in its own group; a sandbox
    deleted normally removes nothing its siblings still need."""
    found = cgroups.hierarchy()
    if isinstance(found, str) or found.version != 1:
        pytest.skip(f"needs writable cgroup v1 groups: {found}")
    mode = require_mode(IsolationMode.BWRAP)
    own = cgroups.CGROUP_ROOT / "memory" / cgroups._own_path("memory").lstrip("/")
    job_group = own / f"rg-test-job-{os.getpid()}"
    job_group.mkdir()
    crashed = textwrap.dedent(
        f"""
        import asyncio, os
        from prime_sandboxes import CreateSandboxRequest
        from rollout_gateway.local_sandbox import LocalSandboxClient

        with open({str(job_group / "cgroup.procs")!r}, "w") as f:
            f.write(str(os.getpid()))  # this "job" runs in its own memory group

        async def main():
            c = LocalSandboxClient({str(root)!r}, isolation={str(mode)!r},
                                   reap_interval=None, sweep_stale=False, register_atexit=False,
                                   warden=False)
            request = CreateSandboxRequest(name="x", docker_image="x", memory_gb=0.0625)
            gone, kept = await c.create(request), await c.create(request)
            await c.delete(gone.id)
            print(kept.id, flush=True)
            os._exit(0)  # a crash: no teardown

        asyncio.run(main())
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", crashed], capture_output=True, text=True, timeout=120
        )
        sid = done.stdout.strip()
        assert sid.startswith("local-"), done.stderr
        recorded = json.loads((root / sid / ".state" / "meta.json").read_text())["cgroups"]
        memory_group = job_group / cgroups.GROUP_NAME / sid
        assert str(memory_group) in recorded and memory_group.is_dir()
        client = make_client(root, mode, sweep_stale=True)  # sweeps from this group
        try:
            assert not (root / sid).exists()
            assert all(not Path(p).exists() for p in recorded)
            assert not (job_group / cgroups.GROUP_NAME).exists()  # nothing left in the job's group
        finally:
            client.teardown()
    finally:
        with contextlib.suppress(OSError):
            (job_group / cgroups.GROUP_NAME).rmdir()
        job_group.rmdir()


def test_a_teardown_during_creation_leaves_nothing_behind(root: Path) -> None:
    """What an interrupted run does (the demo's --timeout, Ctrl-C): the first create of a
    process (its worker still probing the host, then making the sandbox's directories and
    file system) is cancelled and the client torn down at once. The teardown waits for the
    worker: nothing stays mounted, the root is left empty."""
    if disks.availability() is not None:
        pytest.skip(f"no per-sandbox file system here: {disks.availability()}")
    mode = require_mode(IsolationMode.BWRAP)
    interrupted = textwrap.dedent(
        f"""
        import asyncio, contextlib
        from prime_sandboxes import CreateSandboxRequest
        from rollout_gateway.local_sandbox import LocalSandboxClient

        async def main():
            c = LocalSandboxClient({str(root)!r}, isolation={str(mode)!r},
                                   reap_interval=None, sweep_stale=False, register_atexit=False)
            request = CreateSandboxRequest(name="x", docker_image="x", disk_size_gb=0.0625)
            creating = asyncio.create_task(c.create(request))
            await asyncio.sleep(0)
            creating.cancel()
            await asyncio.to_thread(c.teardown)
            with contextlib.suppress(BaseException):
                await creating

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", interrupted], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    mounts = Path("/proc/self/mounts").read_text()
    left = [p.name for p in root.iterdir()]
    for line in mounts.splitlines():  # leave the machine clean even when failing
        if str(root) in line:
            subprocess.run(["umount", "-l", line.split()[1]], check=False)
    assert str(root) not in mounts
    assert left == []
