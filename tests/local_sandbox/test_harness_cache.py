"""The per-machine harness cache: an install runs once per machine, every sandbox runs it
read-only at the path its harness expects, and a sandbox's ``/var/tmp`` is its own."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prime_sandboxes import CreateSandboxRequest

from rollout_gateway.local_sandbox import IsolationMode
from rollout_gateway.local_sandbox.harness_cache import HarnessCache, HarnessInstallError

from .conftest import make_client, require_mode

SCRIPT = b'# /// script\n# requires-python = ">=3.10"\n# dependencies = []\n# ///\nprint("ran")\n'


@pytest.fixture
def cache() -> Iterator[HarnessCache]:
    top = Path(tempfile.mkdtemp(prefix="rg-harness-cache-", dir="/tmp"))
    top.chmod(0o755)
    yield HarnessCache(top / "cache")
    shutil.rmtree(top, ignore_errors=True)


def fill_tool(calls: list[Path]) -> object:
    def fill(staging: Path) -> None:
        calls.append(staging)
        tool = staging / "bin" / "tool"
        tool.parent.mkdir()
        tool.write_text("#!/bin/sh\necho cached tool ran\n")
        tool.chmod(0o700)  # made a+rx by the cache
        (staging / "install.lock").touch()  # where v1's ensure_installed locks

    return fill


def test_a_directory_is_filled_once_even_by_concurrent_callers(cache: HarnessCache) -> None:
    calls: list[Path] = []
    fill = fill_tool(calls)
    threads = [threading.Thread(target=cache.directory, args=("tool", fill)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = cache.directory("tool", fill)  # type: ignore[arg-type]
    assert len(calls) == 1
    assert (made / "bin" / "tool").stat().st_mode & 0o555 == 0o555


def test_a_failed_fill_leaves_nothing_and_the_next_call_fills_again(cache: HarnessCache) -> None:
    def broken(staging: Path) -> None:
        (staging / "half").write_text("x")
        raise OSError("network gone")

    with pytest.raises(OSError, match="network gone"):
        cache.directory("tool", broken)
    assert not (cache.root / "dirs" / "tool").exists()
    assert [p.name for p in (cache.root / "dirs").iterdir()] == []
    calls: list[Path] = []
    assert (cache.directory("tool", fill_tool(calls)) / "bin" / "tool").exists()  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "a/b", ".hidden"])
def test_a_bad_directory_name_is_refused(cache: HarnessCache, name: str) -> None:
    with pytest.raises(ValueError, match="bad directory name"):
        cache.directory(name, lambda staging: None)


def test_a_uv_script_is_installed_once_and_runs_from_the_cache(cache: HarnessCache) -> None:
    pytest.importorskip("uv", reason="uv (PyPI) comes with the [v1] extra")
    first = cache.uv_script(SCRIPT)
    assert first.script.read_bytes() == SCRIPT
    assert cache.root in first.interpreter.parents
    # A new cache object (another process) finds the install on disk.
    again = HarnessCache(cache.root).uv_script(SCRIPT)
    assert again == first


def test_a_uv_script_that_cannot_resolve_raises_a_typed_error(cache: HarnessCache) -> None:
    pytest.importorskip("uv", reason="uv (PyPI) comes with the [v1] extra")
    bad = SCRIPT.replace(b"dependencies = []", b'dependencies = ["no-such-pkg-rg-xyz==0.0.0"]')
    with pytest.raises(HarnessInstallError):
        cache.uv_script(bad)


async def test_sandboxes_run_the_install_at_its_path_read_only_with_their_own_var_tmp(
    root: Path, cache: HarnessCache
) -> None:
    require_mode(IsolationMode.BWRAP)
    made = cache.directory("tool", fill_tool([]))  # type: ignore[arg-type]
    client = make_client(root, IsolationMode.BWRAP, read_only_at={"/var/tmp/vf-tool": str(made)})
    try:
        for n in range(2):
            sandbox = await client.create(CreateSandboxRequest(name="t", docker_image="x"))
            ran = await client.execute_command(sandbox.id, "/var/tmp/vf-tool/bin/tool")
            assert ran.stdout.strip() == "cached tool ran", ran
            tamper = await client.execute_command(
                sandbox.id, "touch /var/tmp/vf-tool/new; echo rc=$?"
            )
            assert "rc=0" not in tamper.stdout, tamper
            # v1's ensure_installed: mkdir, then its ready check under the lock inside the
            # directory; the ready check passes, so the install would be skipped.
            ensure = await client.execute_command(
                sandbox.id,
                "mkdir -p /var/tmp/vf-tool && flock /var/tmp/vf-tool/install.lock "
                "sh -c 'test -x /var/tmp/vf-tool/bin/tool || exit 9'; echo rc=$?",
            )
            assert "rc=0" in ensure.stdout, ensure
            # /var/tmp is writable and private: the other sandbox's file is not there.
            own = await client.execute_command(
                sandbox.id, f"ls /var/tmp; echo {n} > /var/tmp/mine-{n}; echo rc=$?"
            )
            assert "rc=0" in own.stdout and "mine-" not in own.stdout.split("rc=")[0], own
            await client.delete(sandbox.id)
    finally:
        client.teardown()
    assert not (made / "new").exists()


@pytest.mark.parametrize("where", ["relative", "/usr", "/tmp", "/var/../etc"])
def test_a_mount_over_a_system_path_is_refused(root: Path, where: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="read_only_at"):
        make_client(root, IsolationMode.PROCESS_GROUP, read_only_at={where: str(tmp_path)})
