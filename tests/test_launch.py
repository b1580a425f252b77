"""The agent's launch wrapper and stop script, run by a real shell."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rollout_gateway.launch import agent_launch_command, stop_agent_script


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_stop_kills_the_agents_process_tree(tmp_path: Path):
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    command = agent_launch_command(
        "sleep 100 & sleep 101 & echo $! > child.pid; wait", report_exit=False
    )
    agent = await asyncio.create_subprocess_shell(command, env=env, cwd=tmp_path)
    pid_file = tmp_path / ".rollout-gateway-agent.pid"  # in the sandbox's own TMPDIR
    for _ in range(500):
        if pid_file.exists() and (tmp_path / "child.pid").exists():
            break
        await asyncio.sleep(0.01)
    child = int((tmp_path / "child.pid").read_text())
    assert _alive(child)
    stop = await asyncio.create_subprocess_shell(stop_agent_script(), env=env)
    assert await stop.wait() == 0
    assert await asyncio.wait_for(agent.wait(), 5) in (-9, 137)  # killed
    for _ in range(200):
        if not _alive(child):
            break
        await asyncio.sleep(0.01)
    assert not _alive(child), "a child of the agent survived the stop"


async def test_stop_without_an_agent_is_harmless(tmp_path: Path):
    stop = await asyncio.create_subprocess_shell(
        stop_agent_script(), env={"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    )
    assert await stop.wait() == 0
