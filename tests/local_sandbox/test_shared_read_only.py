"""A host directory shared read-only by every sandbox (``read_only``): what is installed
once per machine (the agent CLIs' cache) runs in each sandbox, which cannot change it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prime_sandboxes import CreateSandboxRequest

from rollout_gateway.local_sandbox import IsolationMode

from .conftest import make_client, require_mode


@pytest.fixture
def shared() -> Iterator[Path]:
    """A tool installed outside the sandboxes, under a directory others can traverse."""
    top = Path(tempfile.mkdtemp(prefix="rg-shared-", dir="/tmp"))
    top.chmod(0o755)
    tool = top / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho shared tool ran\n")
    tool.chmod(0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


async def test_every_sandbox_runs_the_shared_tool_and_none_can_change_it(
    root: Path, shared: Path
) -> None:
    require_mode(IsolationMode.BWRAP)
    client = make_client(root, IsolationMode.BWRAP, read_only=[shared])
    try:
        for _ in range(2):
            sandbox = await client.create(CreateSandboxRequest(name="t", docker_image="x"))
            ran = await client.execute_command(sandbox.id, f"{shared}/bin/tool")
            assert ran.stdout.strip() == "shared tool ran", ran
            tamper = await client.execute_command(
                sandbox.id, f"echo x > {shared}/bin/tool; touch {shared}/new; echo rc=$?"
            )
            assert "rc=0" not in tamper.stdout, tamper
            await client.delete(sandbox.id)
    finally:
        client.teardown()
    assert (shared / "bin" / "tool").read_text().endswith("echo shared tool ran\n")
    assert not (shared / "new").exists()


def test_a_shared_path_that_is_no_directory_is_refused(root: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        make_client(root, IsolationMode.PROCESS_GROUP, read_only=[tmp_path / "missing"])


async def test_a_shared_directory_under_var_tmp_is_seen_over_the_sandboxs_own(
    root: Path,
) -> None:
    """The sandbox's /var/tmp is its own temp directory; a shared install under /var/tmp
    (v1's Node harnesses: /var/tmp/vf-node) is still seen there, read-only, not hidden."""
    require_mode(IsolationMode.BWRAP)
    shared = Path(tempfile.mkdtemp(prefix="rg-shared-", dir="/var/tmp"))
    try:
        shared.chmod(0o755)
        (shared / "marker").write_text("installed once\n")
        (shared / "marker").chmod(0o644)
        client = make_client(root, IsolationMode.BWRAP, read_only=[shared])
        try:
            sandbox = await client.create(CreateSandboxRequest(name="t", docker_image="x"))
            seen = await client.execute_command(sandbox.id, f"cat {shared}/marker")
            assert seen.stdout == "installed once\n", seen
            own = await client.execute_command(
                sandbox.id, "echo mine > /var/tmp/own && cat /var/tmp/own"
            )
            assert own.stdout == "mine\n", own
            await client.delete(sandbox.id)
        finally:
            client.teardown()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
