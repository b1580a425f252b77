"""An untrusted agent tries each escape of issue 10; every one must fail in every contained
isolation mode this host offers (modes it lacks are skipped with the reason)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prime_sandboxes import APIError, CreateSandboxRequest

from rollout_gateway.local_sandbox import IsolationMode, LocalSandboxClient, choose_mode
from rollout_gateway.local_sandbox.uids import uid_pids

from .conftest import CONTAINED_MODES, make_client, require_mode
from .procs import assert_none_running, markers, wait_running

HOST_SECRET = "sk-host-secret-4242"
SIBLING_KEY = "sk-sibling-rollout-key-777"


@pytest.fixture(params=CONTAINED_MODES, ids=str)
def contained(request: pytest.FixtureRequest) -> IsolationMode:
    return require_mode(request.param)


@pytest.fixture
async def sandboxes(root: Path, contained: IsolationMode, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOST_ADMIN_TOKEN", HOST_SECRET)  # in the env process's environment
    client = make_client(root, contained)
    yield client
    client.teardown()


async def new(client: LocalSandboxClient, **env: str) -> str:
    sandbox = await client.create(
        CreateSandboxRequest(name="t", docker_image="x", environment_vars=env)
    )
    return sandbox.id


def attempt(label: str, command: str) -> str:
    """Shell that prints ``ESCAPED <label>`` when ``command`` succeeds with output."""
    return f"out=$({command} 2>/dev/null) && [ -n \"$out\" ] && echo 'ESCAPED {label}' || true\n"


async def test_agent_cannot_read_host_or_sibling_secrets(sandboxes: LocalSandboxClient) -> None:
    client = sandboxes
    agent = await new(client)
    sibling = await new(client, OPENAI_API_KEY=SIBLING_KEY)
    (mark,) = markers(1)
    await client.start_background_job(sibling, f"sleep {mark}")
    await wait_running(mark)
    host_file = client.root.parent / "host-secret.txt"
    host_file.write_text(HOST_SECRET)
    host_file.chmod(0o600)

    script = (
        attempt("ppid-environ", f"grep -a {HOST_SECRET} /proc/$PPID/environ")
        + attempt("any-environ-host", f"cat /proc/*/environ | grep -a {HOST_SECRET}")
        + attempt("sibling-environ", f"cat /proc/*/environ | grep -a {SIBLING_KEY}")
        + attempt("host-file", f"cat {host_file}")
        + attempt("own-env", f"env | grep -a {HOST_SECRET}")
        + "echo done\n"
    )
    result = await client.execute_command(agent, script)
    assert result.stdout.strip().splitlines()[-1] == "done", result.stderr
    assert "ESCAPED" not in result.stdout, result.stdout
    job = await client.start_background_job(agent, script)
    for _ in range(500):
        status = await client.get_background_job(agent, job)
        if status.completed:
            break
    assert "ESCAPED" not in (status.stdout or "")


async def test_the_env_admin_token_never_reaches_a_sandbox(
    sandboxes: LocalSandboxClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The classic stack's runtime: the sandbox's whole environment, /proc/self/environ,
    its command line and its files hold nothing of the env's token."""
    token = "rg-admin-token-never-in-a-sandbox-0123"
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", token)
    agent = await new(sandboxes)
    dump = (
        "env; cat /proc/self/environ; cat /proc/self/cmdline; "
        'cat /proc/$$/environ; grep -r . "$HOME" "$TMPDIR" 2>/dev/null; echo done'
    )
    result = await sandboxes.execute_command(agent, dump)
    assert result.stdout.strip().endswith("done"), result.stderr
    assert "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ID" in result.stdout  # the dump is real
    assert token not in result.stdout and "ROLLOUT_GATEWAY_ADMIN_TOKEN" not in result.stdout


async def test_agent_cannot_touch_another_sandbox(sandboxes: LocalSandboxClient) -> None:
    client = sandboxes
    agent = await new(client)
    other = await new(client)
    await client.upload_bytes(other, "secret.txt", b"other's data", "secret.txt")
    other_dir = client.root / other
    script = (
        attempt("read-abs", f"cat {other_dir}/work/secret.txt")
        + attempt("read-rel", f"cat ../../{other}/work/secret.txt")
        + attempt("list", f"ls {other_dir}/work")
        + attempt("list-root", f"ls {client.root} | grep {other}")
        + attempt("state", f"cat {other_dir}/.state/meta.json")
        + f"echo pwn > {other_dir}/work/pwn 2>/dev/null && echo 'ESCAPED write'\n"
        + f"rm -rf {other_dir}/work/secret.txt 2>/dev/null\n"
        + "echo done\n"
    )
    result = await client.execute_command(agent, script)
    assert "ESCAPED" not in result.stdout and "done" in result.stdout, result.stdout
    assert (await client.read_file(other, "secret.txt")).content == "other's data"
    assert not (other_dir / "work" / "pwn").exists()


async def test_file_api_never_follows_a_path_out(sandboxes: LocalSandboxClient) -> None:
    client = sandboxes
    agent = await new(client)
    other = await new(client)
    await client.upload_bytes(other, "secret.txt", b"other's data", "secret.txt")
    host_file = client.root.parent / "host.txt"
    host_file.write_text("host data")
    links = (
        f"ln -s {host_file} leak; ln -s {client.root / other / 'work'} other; "
        "ln -s / slash; mkdir -p d; ln -s .. d/up; ln " + str(host_file) + " hard 2>/dev/null; "
        "true"
    )
    assert (await client.execute_command(agent, links)).exit_code == 0
    for path in ("leak", "other/secret.txt", "slash/etc/passwd", "d/up/x", "../x"):
        with pytest.raises(APIError):
            await client.read_file(agent, path)
        with pytest.raises(APIError):
            await client.upload_bytes(agent, path, b"overwritten", "x")
        with pytest.raises(APIError):
            await client.download_file(agent, path, str(client.root.parent / "dl"))
    # A hard link to a host file (refused by the kernel here, or refused by the file API).
    with pytest.raises(APIError):
        await client.read_file(agent, "hard")
    with contextlib.suppress(APIError):
        await client.upload_bytes(agent, "hard", b"overwritten", "x")
    assert host_file.read_text() == "host data"
    assert (await client.read_file(other, "secret.txt")).content == "other's data"
    assert not (client.root / other / "work" / "x").exists()
    with pytest.raises(APIError):
        await client.read_file(agent, str(client.root / other / "work" / "secret.txt"))


async def test_sandbox_cannot_forge_what_the_stale_sweep_reads(
    sandboxes: LocalSandboxClient, root: Path, contained: IsolationMode
) -> None:
    client = sandboxes
    agent = await new(client)
    victim = await new(client)
    fake = "local-" + "0" * 20
    forged = json.dumps({"owner_pid": 999999999, "uid": 0, "mode": "uid"})
    state = client.root / agent / ".state"
    script = (
        f"echo '{forged}' > {state}/meta.json 2>/dev/null && echo 'ESCAPED meta'\n"
        f"rm -f {state}/lock 2>/dev/null\n"
        f"echo '{forged}' > {client.root / victim}/.state/meta.json 2>/dev/null "
        "&& echo 'ESCAPED victim-meta'\n"
        f"mkdir -p {client.root / fake}/.state 2>/dev/null && echo 'ESCAPED new-dir'\n"
        "echo done\n"
    )
    result = await client.execute_command(agent, script)
    assert "ESCAPED" not in result.stdout and "done" in result.stdout, result.stdout
    assert (state / "lock").exists() and "999999999" not in (state / "meta.json").read_text()
    assert not (client.root / fake).exists()
    # Another client's sweep of the same root leaves live sandboxes alone.
    other_client = make_client(root, contained, sweep_stale=True)
    try:
        assert other_client.sweep_stale() == []
    finally:
        other_client.teardown()
    for sid in (agent, victim):
        assert (await client.execute_command(sid, "echo alive")).stdout == "alive\n"


async def test_delete_leaves_no_process_after_setsid_env_i_double_fork(
    sandboxes: LocalSandboxClient,
) -> None:
    client = sandboxes
    agent = await new(client)
    m1, m2, m3, m4, m5 = markers(5)
    script = (
        f"setsid env -i /bin/sh -c 'sleep {m1}' </dev/null >/dev/null 2>&1 &\n"
        f"(env -i /bin/sh -c 'sleep {m2} &' &)\n"
        f"nohup setsid /bin/sh -c '(setsid sleep {m3} &) ; sleep {m4}' >/dev/null 2>&1 &\n"
        f"sleep {m5}\n"
    )
    # A background job: in the namespace modes, a finished command's namespace (and
    # everything left in it) is already gone, so keep the job alive until delete().
    await client.start_background_job(agent, script)
    await wait_running(m1, m2, m3, m4, m5)
    await client.delete(agent)
    assert_none_running(m1, m2, m3, m4, m5)


def test_stale_sweep_removes_a_crashed_clients_sandboxes(
    root: Path, contained: IsolationMode
) -> None:
    (mark,) = markers(1)
    crashed = textwrap.dedent(
        f"""
        import asyncio, os, sys
        from prime_sandboxes import CreateSandboxRequest
        from rollout_gateway.local_sandbox import LocalSandboxClient

        async def main():
            c = LocalSandboxClient({str(root)!r}, isolation={str(contained)!r},
                                   reap_interval=None, sweep_stale=False, register_atexit=False,
                                   warden=False)
            s = await c.create(CreateSandboxRequest(name="x", docker_image="x"))
            await c.start_background_job(
                s.id, "setsid env -i /bin/sh -c 'sleep {mark}' </dev/null >/dev/null 2>&1 &"
            )
            await asyncio.sleep(0.5)
            print(s.id, flush=True)
            os._exit(0)  # a crash: no teardown

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", crashed], capture_output=True, text=True, timeout=60
    )
    sid = done.stdout.strip()
    assert sid.startswith("local-"), done.stderr
    assert (root / sid).exists()
    client = make_client(root, contained, sweep_stale=True)
    try:
        assert not (root / sid).exists()
        assert_none_running(mark)
    finally:
        client.teardown()


def test_a_killed_clients_warden_removes_its_sandboxes_at_once(
    root: Path, mode: IsolationMode
) -> None:
    """``kill -9`` of the env process: no teardown runs and no other client starts, yet
    its sandboxes and every process they started go within seconds (the warden), in
    every mode (bwrap's --die-with-parent alone would stop the processes only)."""
    (mark,) = markers(1)
    # (A process-group sandbox's processes are found by their group: no setsid there.)
    escape = "" if mode is IsolationMode.PROCESS_GROUP else "setsid env -i "
    killed = textwrap.dedent(
        f"""
        import asyncio, os, signal
        from prime_sandboxes import CreateSandboxRequest
        from rollout_gateway.local_sandbox import LocalSandboxClient

        async def main():
            c = LocalSandboxClient({str(root)!r}, isolation={str(mode)!r},
                                   reap_interval=None, sweep_stale=False, register_atexit=False)
            s = await c.create(CreateSandboxRequest(name="x", docker_image="x"))
            await c.start_background_job(
                s.id, "{escape}/bin/sh -c 'sleep {mark}' </dev/null >/dev/null 2>&1 &"
            )
            await asyncio.sleep(0.5)
            print(s.id, c._warden.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", killed], capture_output=True, text=True, timeout=60
    )
    sid, warden = done.stdout.split()
    assert sid.startswith("local-"), done.stderr
    deadline = time.monotonic() + 20
    while (root / sid).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (root / sid).exists()
    assert_none_running(mark)
    while not _gone(int(warden)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(int(warden))  # its sweep done, it exits


def _gone(pid: int) -> bool:
    """Exited (a zombie until init reaps it, or no longer there)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def test_a_client_torn_down_stands_its_warden_down(root: Path, mode: IsolationMode) -> None:
    client = make_client(root, mode)
    asyncio.run(client.create(CreateSandboxRequest(name="x", docker_image="x")))
    warden = client._warden
    assert warden is not None and warden.pid is not None
    pid = warden.pid
    client.teardown()
    assert warden.pid is None and not Path(f"/proc/{pid}").exists()  # exited, reaped
    assert list(root.iterdir()) == []


def test_auto_never_picks_the_uncontained_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ISOLATION", raising=False)
    try:
        mode = choose_mode("auto")
    except Exception as e:  # no contained mode here: the error says how to opt in
        assert "process-group" in str(e)
    else:
        assert mode is not IsolationMode.PROCESS_GROUP
    monkeypatch.setenv("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ISOLATION", "process-group")
    assert choose_mode() is IsolationMode.PROCESS_GROUP
    with pytest.raises(Exception, match="unknown local sandbox isolation"):
        choose_mode("chroot")


async def test_each_sandbox_has_its_own_uid_and_private_dirs(
    sandboxes: LocalSandboxClient,
) -> None:
    client = sandboxes
    if not client.isolation.uses_sandbox_uid:
        pytest.skip("per-sandbox uids need root")
    a, b = await new(client), await new(client)
    uid_a = int((await client.execute_command(a, "id -u")).stdout)
    uid_b = int((await client.execute_command(b, "id -u")).stdout)
    assert uid_a != uid_b and 0 not in (uid_a, uid_b)
    for sid, uid in ((a, uid_a), (b, uid_b)):
        work = os.stat(client.root / sid / "work")
        assert (work.st_uid, work.st_mode & 0o777) == (uid, 0o700)
        state = os.stat(client.root / sid / ".state")
        assert (state.st_uid, state.st_mode & 0o777) == (os.geteuid(), 0o700)
    await client.start_background_job(a, "sleep 600")
    await client.delete(a)
    assert uid_pids(uid_a) == set()
