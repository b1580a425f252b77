"""Sandbox disks of a process killed mid-setup are removed by the next client's sweep,
whatever its root (issue 34: demos and tests killed under load left loop mounts and disk
images under pytest's temporary directories, roots no later client opens again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_gateway import child_processes
from rollout_gateway.local_sandbox import LocalSandboxClient, disks, layout

SID = "local-" + "b" * 20


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Records of this test's disks only (its sweep sees no other run's)."""
    why = disks.availability()
    if why is not None:
        pytest.skip(f"no sandbox disks here: {why}")
    path = tmp_path / "records"
    monkeypatch.setenv(disks.RECORDS_ENV, str(path))
    yield path


def _killed_mid_setup(root: Path) -> None:
    """A process creating sandbox ``SID`` in ``root``, killed with ``kill -9`` once its
    disk is mounted and before its creation finishes (as a demo stopped while seeding)."""
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from rollout_gateway.local_sandbox import disks, layout

        root = Path({str(root)!r})
        def mount(base):
            disks.create(layout.disk_image(root, {SID!r}), base, 16 * 1024 * 1024)
            print("mounted", flush=True)
            time.sleep(600)

        layout.create_dirs(layout.SandboxDirs(root / {SID!r}), None, {{}}, False, mount)
        """
    )
    # Its own group (killed with SIGKILL below, as a crash), and killed so by the kernel
    # should this test process die first: nothing is left sleeping on a mount.
    proc = child_processes.spawn([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "mounted\n"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # our own group (spawn's new session)
        proc.wait()


def test_the_next_client_removes_the_disk_of_a_process_killed_mid_setup(
    tmp_path: Path, records: Path
) -> None:
    old_root = tmp_path / "killed-run"  # a root no client opens again
    old_root.mkdir()
    _killed_mid_setup(old_root)
    assert disks.mounted(old_root / SID)
    assert layout.disk_image(old_root, SID).exists()
    assert len(list(records.glob("*.json"))) == 1

    client = LocalSandboxClient(tmp_path / "next-run", reap_interval=None, register_atexit=False)
    client.delete_all()

    assert not disks.mounted(old_root / SID)
    assert not layout.disk_image(old_root, SID).exists()
    assert not (old_root / SID).exists()
    assert os.listdir(records) == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(old_root) not in mounts


def test_a_live_makers_disk_and_what_is_not_ours_are_left_alone(
    tmp_path: Path, records: Path
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    disks.create(tmp_path / "mine.disk", mine, 16 * 1024 * 1024)  # this process: alive
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(foreign)], check=True)
    try:
        # A record (its maker gone) naming a mount point where something else is mounted.
        record = {"image": str(tmp_path / "foreign.disk"), "mount_point": str(foreign)}
        (records / "0123456789abcdef.json").write_text(json.dumps(record))
        assert disks.sweep_abandoned() == [str(foreign)]
        assert disks.mounted(foreign)  # not a loop mount of the recorded image: kept
        assert disks.mounted(mine) and (tmp_path / "mine.disk").exists()
        assert len(list(records.glob("*.json"))) == 1  # mine, held
    finally:
        subprocess.run(["umount", str(foreign)], check=False)
        disks.remove(tmp_path / "mine.disk", mine)
    assert not disks.mounted(mine) and not (tmp_path / "mine.disk").exists()
    assert os.listdir(records) == []
