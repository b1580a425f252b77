"""Running a real agent CLI against a rollout of an in-process gateway in front of the
scripted model, as a sandboxed agent runs: its own home and working directory, the
rollout's variables and nothing of the host's environment, in its own process group."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_gateway import child_processes
from rollout_gateway.agent_clis import AgentCli
from rollout_gateway.lifecycle import agent_environment
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.scripted.faults import Ledger
from rollout_gateway.server import GatewayConfig, create_app, running_server

ADMIN = "agent-clis-admin-token-0123456789"
#: Set by CI (``.ci/run``): a missing CLI fails the test instead of skipping it.
REQUIRE_VAR = "ROLLOUT_GATEWAY_REQUIRE_AGENT_CLIS"
#: Seconds a CLI gets for a small task (each turn is one local call).
CLI_TIMEOUT = 180.0


def program_of(cli: AgentCli) -> Path:
    """The installed CLI, else a skip that says how to install it (a failure in CI)."""
    program = cli.executable()
    if program is None:
        message = f"SKIPPED, real CLI missing: {cli.install_hint()}"
        if os.environ.get(REQUIRE_VAR) == "1":
            pytest.fail(message)
        pytest.skip(message)
    return program


def network_tracer(trace: Path) -> str:
    """A command prefix recording the CLI's connections (``strace``) into ``trace``, or
    ``""`` where strace cannot trace here (not installed, ptrace not allowed)."""
    strace = shutil.which("strace")
    if strace is None:
        return ""
    probe = subprocess.run([strace, "-f", "-o", "/dev/null", "true"], capture_output=True)
    if probe.returncode != 0:
        return ""
    # env: the CLI's command starts with variable assignments.
    flags = "-f -qq -e trace=connect,sendto,sendmsg"
    return f"{shlex.quote(strace)} {flags} -o {shlex.quote(str(trace))} env "


#: An address a traced call reached: ``sin_addr=inet_addr("...")`` or ``inet_pton(...)``.
_ADDRESS = re.compile(r'(?:inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)")')


def remote_addresses(trace: Path) -> set[str]:
    """The IP addresses the traced process tree connected or sent to."""
    found = set()
    for line in trace.read_text().splitlines():
        for v4, v6 in _ADDRESS.findall(line):
            found.add(v4 or v6)
    return found


@dataclass
class CliRun:
    """What one CLI run left: its exit, output, working directory and the trajectory."""

    returncode: int
    stdout: str
    stderr: str
    work: Path
    trajectory: dict[str, Any]
    served: list[dict[str, Any]]


@dataclass
class Gateway:
    """The gateway and the scripted model behind it, on loopback."""

    root: str
    ledger: Path

    async def run_cli(
        self, cli: AgentCli, program: Path, prompt: str, tmp: Path, *, wrap: str = ""
    ) -> CliRun:
        """Register a rollout, run ``cli`` on ``prompt`` against it, fetch its trajectory."""
        rollout_id = f"cli-{os.urandom(6).hex()}"
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(base_url=self.root, headers=headers) as control:
            r = await control.post(f"/v1/rollouts/{rollout_id}/register", json={"model": "m"})
            r.raise_for_status()
            key = r.json()["api_key"]
            work, home = tmp / "work", tmp / "home"
            work.mkdir()
            home.mkdir()
            (work / "task.md").write_text(prompt)
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": str(home),
                "LANG": "C.UTF-8",
                **agent_environment(
                    f"{self.root}/v1/rollouts/{rollout_id}", key, "scripted", CLI_TIMEOUT
                ),
            }
            command = wrap + cli.command(str(program), '"$(cat task.md)"')
            code, out, err = await run_in_group(command, work, env, CLI_TIMEOUT)
            r = await control.get(f"/v1/rollouts/{rollout_id}/trajectory")
            r.raise_for_status()
            trajectory = r.json()
            await control.post(f"/v1/rollouts/{rollout_id}/unregister")
        served = [json.loads(line) for line in self.ledger.read_text().splitlines()]
        return CliRun(code, out, err, work, trajectory, served)


async def run_in_group(
    command: str, cwd: Path, env: dict[str, str], timeout: float
) -> tuple[int, str, str]:
    """``command`` under ``sh`` in its own process group, killed whole on timeout or
    should this process die (even by ``kill -9``)."""
    proc = await child_processes.spawn_async(
        "/bin/sh",
        "-c",
        command,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        whole_group=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = await proc.communicate()
        err += f"\n[killed after {timeout} s: {shlex.quote(command)[:200]}]".encode()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the CLI left running
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


@contextlib.asynccontextmanager
async def gateway(tmp: Path) -> AsyncIterator[Gateway]:
    """The scripted model (every completion in its ledger) and a gateway in front of it."""
    ledger = tmp / "ledger.jsonl"
    ledger.touch()
    async with running_server(create_scripted_model_app(ledger=Ledger(ledger))) as model:
        config = GatewayConfig(upstreams=[f"{model}/v1"], admin_token=ADMIN)
        async with running_server(create_app(config)) as root:
            yield Gateway(root, ledger)
