"""The stale sweep and a sandbox whose creation was cut short (issue 34's soak: an env
process killed with ``kill -9`` while a sandbox's disk was being mounted left the mounted
directory, its loop device and its image behind: the sweep saw no ``.state/lock``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from rollout_gateway import child_processes
from rollout_gateway.local_sandbox import layout

SID = "local-" + "a" * 20


def _creation_stuck_in_mount(root: Path) -> subprocess.Popen[str]:
    """A process creating ``SID`` in ``root`` whose mount step never returns (as a slow
    ``mkfs`` and ``mount`` on a loaded host); it prints ``mounting`` when it is there."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from rollout_gateway.local_sandbox import layout

        def mount(base):
            print("mounting", flush=True)
            time.sleep(600)

        root = Path({str(root)!r})
        dirs = layout.SandboxDirs(root / {SID!r})
        layout.create_dirs(dirs, None, {{}}, False, mount)
        """
    )
    # Its own group (killed with SIGKILL below, as a crash), and killed so by the kernel
    # should this test process die first: nothing is left sleeping on a mount.
    proc = child_processes.spawn([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "mounting\n"
    return proc


def test_a_creation_under_way_is_left_alone_and_one_killed_midway_is_swept(
    tmp_path: Path,
) -> None:
    root = tmp_path / "sandboxes"
    root.mkdir()
    proc = _creation_stuck_in_mount(root)
    try:
        assert (root / SID).is_dir() and not (root / SID / ".state").exists()
        assert layout.sweep_stale(root) == []  # its creator is alive
        assert (root / SID).is_dir()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # our own group (spawn's new session)
        proc.wait()
    assert layout.sweep_stale(root) == [SID]
    assert sorted(os.listdir(root)) == []  # the directory and the creation lock


def test_a_finished_creation_leaves_no_creation_lock(tmp_path: Path) -> None:
    dirs = layout.SandboxDirs(tmp_path / SID)
    lock_fd = layout.create_dirs(dirs, None, {}, False)
    try:
        assert sorted(os.listdir(tmp_path)) == [SID]
        assert layout.sweep_stale(tmp_path) == []  # held: alive
    finally:
        os.close(lock_fd)
    assert layout.sweep_stale(tmp_path) == [SID]
