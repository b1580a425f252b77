"""Agent exit reports: the board, the env's watcher, and the launch wrapper on a real gateway."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from core_world import no_wait

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient
from rollout_gateway.exits import ExitBoard, ExitWatcher
from rollout_gateway.launch import agent_launch_command
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.testing import FakeGateway


async def test_the_board_numbers_reports_and_forgets_unregistered_rollouts():
    board = ExitBoard()
    board.report("a", 0)
    board.report("b", 3)
    first = board.since(0)
    assert [(r["rollout_id"], r["exit_code"]) for r in first["exits"]] == [("a", 0), ("b", 3)]
    assert board.since(first["cursor"])["exits"] == []
    board.forget("a")
    assert [r["rollout_id"] for r in board.since(0)["exits"]] == ["b"]
    # A cursor from before a gateway restart is beyond ours: everything is new to it.
    assert [r["rollout_id"] for r in board.since(10_000)["exits"]] == ["b"]


async def test_the_long_poll_wakes_on_a_report():
    board = ExitBoard()
    waiter = asyncio.ensure_future(board.wait(0, timeout=5))
    await asyncio.sleep(0)
    assert not waiter.done()
    board.report("a", 0)
    answer = await asyncio.wait_for(waiter, 1)
    assert answer["exits"][0]["rollout_id"] == "a"


async def test_the_watcher_delivers_reports_and_keeps_early_ones():
    gateway = FakeGateway()
    gateway.rollouts["r1"] = gateway.rollouts["r2"] = None  # type: ignore[assignment]
    async with GatewayClient("http://gw.test:8000", transport=gateway.transport()) as client:
        watcher = ExitWatcher(client, sleep=no_wait)
        gateway.exit_board.report("r2", 7)  # before anyone waits for it
        hint = watcher.subscribe("r1")
        gateway.exit_board.report("r1", 0)
        assert await asyncio.wait_for(hint, 2) == 0
        assert watcher.supported is True
        early = watcher.subscribe("r2")
        assert await asyncio.wait_for(early, 2) == 7
        await watcher.aclose()


async def test_the_watcher_coalesces_a_burst_of_exits_into_few_polls():
    gateway = FakeGateway()
    ids = [f"r{i}" for i in range(20)]
    for rid in ids:
        gateway.rollouts[rid] = None  # type: ignore[assignment]
    pauses: list[float] = []

    async def pause(seconds: float) -> None:  # the coalescing window, made deterministic
        pauses.append(seconds)
        for rid in ids[1:]:
            gateway.exit_board.report(rid, 0)  # the rest of the burst exits meanwhile

    async with GatewayClient("http://gw.test:8000", transport=gateway.transport()) as client:
        watcher = ExitWatcher(client, sleep=pause)
        hints = [watcher.subscribe(rid) for rid in ids]
        gateway.exit_board.report(ids[0], 0)
        assert await asyncio.wait_for(asyncio.gather(*hints), 2) == [0] * 20
        await watcher.aclose()
    # One answer with the first exit, a pause, one answer with the other 19 (plus the
    # first support probe): not one poll per exit.
    assert gateway.op_counts["exits"] <= 4
    assert pauses and pauses[0] == pytest.approx(0.01)


async def test_the_watcher_turns_off_for_a_gateway_without_the_extension():
    gateway = FakeGateway(exit_reports=False)
    async with GatewayClient("http://gw.test:8000", transport=gateway.transport()) as client:
        watcher = ExitWatcher(client, sleep=no_wait)
        hint = watcher.subscribe("r1")
        for _ in range(100):
            if watcher.supported is False:
                break
            await asyncio.sleep(0)
        assert watcher.supported is False and not hint.done()
        watcher.unsubscribe("r1")
        await watcher.aclose()


def _path_with_only(tmp_path: Path, *tools: str) -> str:
    """A PATH holding just ``tools`` (and sh), to pick the wrapper's HTTP client."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", *tools):
        found = sys.executable if tool == "python3" else shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed here")
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.parametrize("client_tool", ["curl", "wget", "python3"])
async def test_the_launch_wrapper_reports_the_exit_to_the_reference_gateway(
    tmp_path: Path, client_tool: str
):
    config = GatewayConfig(
        upstreams=["http://127.0.0.1:9/v1"], require_rollout_keys=True, admin_token="adm"
    )
    async with running_server(create_app(config)) as root:
        async with GatewayClient(root, admin_token="adm") as client:
            rollout_id = protocol.new_rollout_id()
            answer = await client.register(
                rollout_id, model="m", api_key=protocol.new_rollout_api_key()
            )
            env = {
                "PATH": _path_with_only(tmp_path, client_tool),
                "OPENAI_BASE_URL": protocol.rollout_base_url(root, rollout_id),
                "OPENAI_API_KEY": answer["api_key"],
            }
            pid_file = tmp_path / "agent.pid"
            command = agent_launch_command("exit 3", shlex.quote(str(pid_file)))
            process = await asyncio.create_subprocess_shell(command, env=env)
            assert await process.wait() == 3  # the agent's own exit code is kept
            assert pid_file.read_text().strip().isdigit()
            reports = await client.wait_exits(0, 5)
            assert [(r["rollout_id"], r["exit_code"]) for r in reports["exits"]] == [
                (rollout_id, 3)
            ]
            await client.unregister(rollout_id)
            assert (await client.wait_exits(0, 0))["exits"] == []


async def test_an_exit_report_needs_the_rollouts_key():
    config = GatewayConfig(
        upstreams=["http://127.0.0.1:9/v1"], require_rollout_keys=True, admin_token="adm"
    )
    async with running_server(create_app(config)) as root:
        async with GatewayClient(root, admin_token="adm") as client:
            rollout_id = protocol.new_rollout_id()
            await client.register(rollout_id, model="m", api_key=protocol.new_rollout_api_key())
            import httpx

            async with httpx.AsyncClient(base_url=root) as http:
                forged = await http.post(
                    protocol.exit_path(rollout_id),
                    json={"exit_code": 0},
                    headers={"Authorization": "Bearer " + "x" * 43},
                )
                assert forged.status_code == 401
                unauthenticated = await http.get(protocol.EXITS_PATH)
                assert unauthenticated.status_code == 401
            assert (await client.wait_exits(0, 0))["exits"] == []


def test_the_wrapper_without_reports_execs_the_agent():
    command = agent_launch_command("python agent.py", "/tmp/p", report_exit=False)
    assert "exec sh -c" in command and "exit_code" not in command
    assert os.path.basename("/tmp/p") in command
