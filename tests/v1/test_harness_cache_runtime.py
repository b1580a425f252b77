"""The ``local_sandbox`` runtime's ``prepare_uv_script``: a harness's PEP 723 program is
installed once per machine into the harness cache and run read-only by every sandbox,
with nothing of the host's environment; a cache the sandboxes cannot reach is refused."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import LocalSandboxRuntimeConfig
from rollout_gateway.v1.internals import SandboxError
from rollout_gateway.v1.runtime import LocalSandboxRuntime

SCRIPT = (
    '# /// script\n# requires-python = ">=3.10"\n# dependencies = []\n# ///\n'
    "import os, sys\n"
    'print("secret" if "RG_HOST_ONLY_SECRET" in os.environ else "clean", sys.prefix)\n'
)


def require(mode: IsolationMode) -> None:
    if (reason := unavailable_reasons()[mode]) is not None:
        pytest.skip(f"{mode} unavailable here: {reason}")


@pytest.fixture
def top() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rg-harness-rt-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_the_program_installs_once_and_runs_read_only_without_the_hosts_env(
    top: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require(IsolationMode.BWRAP)
    pytest.importorskip("uv")
    monkeypatch.setenv("RG_HOST_ONLY_SECRET", "x")  # the host's; must not reach the agent
    config = LocalSandboxRuntimeConfig(
        isolation="bwrap", root=str(top / "sandboxes"), harness_cache_root=str(top / "cache")
    )
    argvs = []
    for _ in range(2):
        runtime = LocalSandboxRuntime(config)
        await runtime.start()
        try:
            argv = await runtime.prepare_uv_script(SCRIPT, {}, activate=False)
            argvs.append(argv)
            ran = await runtime.run(argv, {})
            assert ran.exit_code == 0, ran
            assert ran.stdout.split()[0] == "clean", ran
            activated = await runtime.prepare_uv_script(SCRIPT, {})
            assert (await runtime.run(activated, {})).stdout.split()[0] == "clean"
            tamper = await runtime.run(["sh", "-c", f"echo x >> {argv[1]}; echo rc=$?"], {})
            assert "rc=0" not in tamper.stdout, tamper
        finally:
            await runtime.stop()
    assert argvs[0] == argvs[1]
    assert argvs[0][1].startswith(str(top / "cache"))
    assert Path(argvs[0][1]).read_text() == SCRIPT


async def test_a_cache_the_sandbox_uids_cannot_reach_is_refused_with_the_fix(top: Path) -> None:
    require(IsolationMode.UID)
    private = top / "private"
    private.mkdir(mode=0o700)
    config = LocalSandboxRuntimeConfig(
        isolation="uid",
        root=str(top / "sandboxes"),
        harness_cache_root=str(private / "cache"),
    )
    os.chmod(top, 0o755)
    runtime = LocalSandboxRuntime(config)
    await runtime.start()
    try:
        with pytest.raises(SandboxError, match="harness_cache_root"):
            await runtime.prepare_uv_script(SCRIPT, {})
    finally:
        await runtime.stop()


def test_the_reachability_check_names_the_blocking_directory(top: Path) -> None:
    from rollout_gateway.v1.runtime import _check_traversable

    private = top / "private"
    (private / "cache").mkdir(parents=True)
    private.chmod(0o700)
    with pytest.raises(SandboxError, match=f"{private} is not traversable"):
        _check_traversable(private / "cache")
    private.chmod(0o755)
    _check_traversable(private / "cache")
