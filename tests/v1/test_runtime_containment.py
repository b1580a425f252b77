"""Containment on the v1 ``local_sandbox`` runtime: the classic backend's escape probes,
and agents that fork without end, fill their disk or memory, or ignore SIGTERM, each
stopped at its limit while a sibling sandbox and the env keep running (tiny limits)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_sandbox.procs import assert_none_running, markers, wait_running
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes import make_runtime

from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import LocalSandboxRuntime, LocalSandboxRuntimeConfig

HOST_SECRET = "sk-host-secret-v1-4242"
SIBLING_KEY = "sk-sibling-rollout-key-v1-777"
CONTAINED = [m for m in IsolationMode if m is not IsolationMode.PROCESS_GROUP]


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rg-v1-contain-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path / "sandboxes"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=CONTAINED, ids=str)
def mode(request: pytest.FixtureRequest) -> str:
    reason = unavailable_reasons()[request.param]
    if reason is not None:
        pytest.skip(f"isolation {request.param} unavailable here: {reason}")
    return str(request.param)


async def started(root: Path, mode: str, **limits: object) -> LocalSandboxRuntime:
    config = LocalSandboxRuntimeConfig(isolation=mode, root=str(root), **limits)  # type: ignore[arg-type]
    runtime = make_runtime(config)
    assert isinstance(runtime, LocalSandboxRuntime)
    await runtime.start()
    return runtime


def attempt(label: str, command: str) -> str:
    return f"out=$({command} 2>/dev/null) && [ -n \"$out\" ] && echo 'ESCAPED {label}' || true\n"


async def test_agent_cannot_read_host_or_sibling_secrets_or_touch_a_sibling(
    root: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_ADMIN_TOKEN", HOST_SECRET)  # in the env process's environment
    agent, sibling = await started(root, mode), await started(root, mode)
    try:
        (mark,) = markers(1)
        await sibling.run_background(["sleep", str(mark)], {"OPENAI_API_KEY": SIBLING_KEY}, "l")
        await wait_running(mark)
        await sibling.write("secret.txt", b"sibling's data")
        host_file = root.parent / "host-secret.txt"
        host_file.write_text(HOST_SECRET)
        host_file.chmod(0o600)
        other = sibling.workdir
        assert other is not None
        script = (
            attempt("ppid-environ", f"grep -a {HOST_SECRET} /proc/$PPID/environ")
            + attempt("any-environ-host", f"cat /proc/*/environ | grep -a {HOST_SECRET}")
            + attempt("sibling-environ", f"cat /proc/*/environ | grep -a {SIBLING_KEY}")
            + attempt("host-file", f"cat {host_file}")
            + attempt("own-env", f"env | grep -a {HOST_SECRET}")
            + attempt("sibling-read", f"cat {other}/secret.txt")
            + attempt("sibling-list", f"ls {other}")
            + attempt("root-list", f"ls {root} | grep {sibling.sandbox_id}")
            + f"echo pwn > {other}/pwn 2>/dev/null && echo 'ESCAPED sibling-write'\n"
            + f"echo pwn > {root.parent}/pwn 2>/dev/null && echo 'ESCAPED host-write'\n"
            + "echo done\n"
        )
        result = await agent.run(["sh", "-c", script], {})
        assert result.stdout.strip().splitlines()[-1] == "done", result.stderr
        assert "ESCAPED" not in result.stdout, result.stdout
        assert await sibling.read("secret.txt") == b"sibling's data"
        assert not (other / "pwn").exists() and not (root.parent / "pwn").exists()
        # The runtime's own file I/O never follows a path out either.
        await agent.run(["sh", "-c", f"ln -s {host_file} leak; ln -s {other} sib"], {})
        for path in ("leak", "sib/secret.txt", "../x", str(host_file), f"{other}/secret.txt"):
            with pytest.raises((SandboxError, FileNotFoundError)):
                await agent.read(path)
            with pytest.raises(SandboxError):
                await agent.write(path, b"overwritten")
        assert host_file.read_text() == HOST_SECRET
    finally:
        await agent.stop()
        await sibling.stop()


@pytest.mark.parametrize(
    ("what", "command", "reason"),
    [
        ("fork bomb", "b() { b | b & }; b; sleep 600", "process limit (32) reached"),
        (
            "disk fill",
            "for i in 1 2 3 4 5 6 7 8; do head -c 8388608 /dev/zero > f$i; done; sleep 600",
            "disk limit (32 MiB) reached",
        ),
        (
            "memory hog",
            f"{sys.executable} -c 'x = bytearray(256 << 20); print(len(x))'; sleep 600",
            "memory limit (64 MiB) reached",
        ),
    ],
)
async def test_agent_is_stopped_at_its_limit_while_a_sibling_runs(
    root: Path, mode: str, what: str, command: str, reason: str
) -> None:
    from rollout_gateway.local_sandbox import cgroups

    if what != "disk fill" and cgroups.availability() is not None:
        pytest.skip(f"no cgroups here ({cgroups.availability()}): the rlimits apply instead")
    memory = 64 if what == "memory hog" else 512  # a fork bomb meets the process limit first
    limits = {"pids": 32, "memory": memory / 1024, "disk": 32 / 1024}
    agent, sibling = await started(root, mode, **limits), await started(root, mode, **limits)
    try:
        result = await agent.run_program(["sh", "-c", command], {})
        assert result.exit_code != 0
        assert reason in result.stderr, result.stderr[-500:]
        ok = await sibling.run(["sh", "-c", "echo fine > f && cat f"], {})
        assert (ok.exit_code, ok.stdout) == (0, "fine\n")
    finally:
        await agent.stop()
        await sibling.stop()
    assert agent.workdir is not None and not agent.workdir.parent.exists()


async def test_sigterm_ignoring_agent_is_killed_when_the_runtime_stops(
    root: Path, mode: str
) -> None:
    m1, m2 = markers(2)
    runtime = await started(root, mode)
    script = f"trap '' TERM; (trap '' TERM; setsid sleep {m1} &); sleep {m2} & wait"
    await runtime.run_background(["sh", "-c", script], {}, "agent.log")
    await wait_running(m1, m2)
    await runtime.stop()
    assert_none_running(m1, m2)
    assert runtime.workdir is not None and not runtime.workdir.parent.exists()
