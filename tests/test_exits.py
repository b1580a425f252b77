"""Agent exit reports: the board, the env's watcher, and the launch wrapper on a real gateway."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from core_world import no_wait

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient
from rollout_gateway.exits import STREAM_REOPEN_PAUSE, ExitBoard, ExitWatcher
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


async def test_a_board_restored_or_fed_from_elsewhere_numbers_on():
    """A restarted gateway's board is filled again from its store; a report numbered at
    another gateway (a shared store) is applied as numbered: cursors stay valid."""
    saved: list[dict] = []

    class Journal:
        def exit_saved(self, report):
            saved.append(dict(report))

        def exit_forgotten(self, rollout_id):
            saved.append({"forgot": rollout_id})

    board = ExitBoard(journal=Journal())
    board.restore([{"rollout_id": "a", "exit_code": 0, "seq": 4}], cursor=6)
    assert board.cursor == 6 and board.since(0)["exits"][0]["rollout_id"] == "a"
    board.report("b", 1)
    assert saved == [{"rollout_id": "b", "exit_code": 1, "seq": 7}]
    waiting = asyncio.ensure_future(board.wait(7, 10))
    await asyncio.sleep(0)
    board.apply({"rollout_id": "c", "exit_code": 2, "seq": 9})
    assert [r["rollout_id"] for r in (await waiting)["exits"]] == ["c"]
    assert board.cursor == 9
    board.forget("a")
    assert saved[-1] == {"forgot": "a"}


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


async def test_the_long_poll_waits_without_a_helper_task():
    board = ExitBoard()
    before = len(asyncio.all_tasks())
    waiters = [asyncio.ensure_future(board.wait(0, timeout=5)) for _ in range(10)]
    await asyncio.sleep(0)
    # One task per waiter (the test's own), none added by the wait (wait_for made one each).
    assert len(asyncio.all_tasks()) == before + 10
    board.report("a", 0)
    answers = await asyncio.wait_for(asyncio.gather(*waiters), 1)
    assert all(a["exits"][0]["rollout_id"] == "a" for a in answers)


async def test_the_board_stream_starts_with_the_missed_reports_and_its_cursor():
    board = ExitBoard()
    board.report("a", 0)
    board.report("b", 1)
    # A cursor from before a gateway restart (beyond ours) gets everything, and the
    # heartbeat's cursor (2) is lower than the one it came with: the client follows it.
    lines = board.follow(10, keepalive=0)
    first = [protocol.parse_exit_stream_line(raw) for raw in (await anext(lines)).splitlines()]
    assert first == [
        {"rollout_id": "a", "exit_code": 0, "seq": 1},
        {"rollout_id": "b", "exit_code": 1, "seq": 2},
        {"cursor": 2},
    ]
    assert await anext(lines) == protocol.exit_stream_line({"cursor": 2})  # keepalive
    await lines.aclose()


async def test_an_agent_repeating_its_exit_report_wakes_the_streams_once_per_interval():
    """One agent posting reports in a loop must not make every env's stream carry a line
    per post: repeats within the interval are stored and delivered together with the
    next wake, at the latest when the interval ends; other rollouts are not delayed."""
    now = [0.0]
    board = ExitBoard(wake_interval=10.0, clock=lambda: now[0])
    lines = board.follow(0, keepalive=60)

    async def next_lines() -> list[protocol.ExitStreamLine]:
        chunk = await asyncio.wait_for(anext(lines), 2)
        return [protocol.parse_exit_stream_line(raw) for raw in chunk.splitlines()]

    assert await next_lines() == [{"cursor": 0}]
    board.report("a", 1)
    assert await next_lines() == [{"rollout_id": "a", "exit_code": 1, "seq": 1}]
    now[0] = 9.999  # the interval of "a" ends 1 ms (of the loop's time) from here
    for code in range(2, 102):
        board.report("a", code)
    # Had each repeat woken the stream, its next chunk would hold exit code 2.
    assert await next_lines() == [{"rollout_id": "a", "exit_code": 101, "seq": 101}]
    board.report("a", 102)  # within the interval again, and "b" comes meanwhile
    board.report("b", 0)
    assert await next_lines() == [
        {"rollout_id": "a", "exit_code": 102, "seq": 102},
        {"rollout_id": "b", "exit_code": 0, "seq": 103},
    ]
    await lines.aclose()


async def _settle(predicate, rounds: int = 200) -> None:
    """Yield to the loop until ``predicate()`` (no wall-clock waiting)."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def test_the_stream_delivers_a_burst_of_exits_over_one_connection():
    gateway = FakeGateway()
    ids = [f"r{i}" for i in range(50)]
    for rid in ids:
        gateway.rollouts[rid] = None  # type: ignore[assignment]
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        await asyncio.sleep(0)

    async with GatewayClient("http://gw.test:8000", transport=gateway.transport()) as client:
        watcher = ExitWatcher(client, sleep=pause)
        hints = [watcher.subscribe(rid) for rid in ids]
        await _settle(lambda: len(gateway.exit_streams) == 1)
        for i, rid in enumerate(ids):  # the burst: one exit after the other
            gateway.exit_board.report(rid, i % 3)
            await asyncio.sleep(0)
        assert await asyncio.wait_for(asyncio.gather(*hints), 2) == [i % 3 for i in range(50)]
        assert watcher.streaming is True and watcher.supported is True
        assert watcher.cursor == 50
        await watcher.aclose()
        assert gateway.exit_streams == []  # closed with the watcher
    # One request for the whole burst, no coalescing pause, no poll.
    assert gateway.op_counts["exits"] == 1 and gateway.exit_stream_cursors == [0]
    assert pauses == []


async def test_the_stream_resumes_from_its_cursor_after_the_gateway_drops_it():
    gateway = FakeGateway()
    for rid in ("r1", "r2", "r3"):
        gateway.rollouts[rid] = None  # type: ignore[assignment]
    pauses: list[float] = []

    async def pause(seconds: float) -> None:  # the reconnect pause: r2 exits meanwhile
        pauses.append(seconds)
        gateway.exit_board.report("r2", 2)

    async with GatewayClient("http://gw.test:8000", transport=gateway.transport()) as client:
        watcher = ExitWatcher(client, sleep=pause)
        first, second = watcher.subscribe("r1"), watcher.subscribe("r2")
        gateway.exit_board.report("r3", 3)  # nobody waits for it yet: kept
        gateway.exit_board.report("r1", 1)
        assert await asyncio.wait_for(first, 2) == 1
        gateway.drop_exit_streams()
        assert await asyncio.wait_for(second, 2) == 2
        assert await asyncio.wait_for(watcher.subscribe("r3"), 2) == 3
        await watcher.aclose()
    # Reopened once, from the last report seen (r1's, seq 2): nothing sent twice.
    assert gateway.exit_stream_cursors == [0, 2]
    assert pauses == [STREAM_REOPEN_PAUSE]


class _OlderGateway:
    """A gateway that refuses ``stream=1`` with ``status`` but serves the long-poll."""

    def __init__(self, gateway: FakeGateway, status: int) -> None:
        self.gateway, self.status, self.refused = gateway, status, 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.params.get("stream") == "1":
            self.refused += 1
            return httpx.Response(self.status, json={"error": {"message": "no"}})
        return await self.gateway.handle(request)


@pytest.mark.parametrize("lacks", ["ignores stream=1", 400, 404, 405])
async def test_a_gateway_without_the_stream_is_long_polled(lacks: str | int):
    gateway = FakeGateway(exit_stream=lacks != "ignores stream=1")
    older = _OlderGateway(gateway, lacks) if isinstance(lacks, int) else gateway
    for rid in ("r1", "r2"):
        gateway.rollouts[rid] = None  # type: ignore[assignment]
    transport = httpx.MockTransport(older.handle)
    async with GatewayClient("http://gw.test:8000", transport=transport) as client:
        watcher = ExitWatcher(client, sleep=no_wait, coalesce=0)
        first = watcher.subscribe("r1")
        gateway.exit_board.report("r1", 0)
        assert await asyncio.wait_for(first, 2) == 0
        second = watcher.subscribe("r2")
        gateway.exit_board.report("r2", 5)
        assert await asyncio.wait_for(second, 2) == 5
        assert watcher.streaming is False and watcher.supported is True
        await watcher.aclose()
    assert gateway.exit_stream_cursors == []  # never streamed
    assert getattr(older, "refused", 1) == 1  # asked for the stream once only


async def test_a_refused_stream_long_polls_once_then_streams():
    gateway = FakeGateway()
    gateway.rollouts["r1"] = gateway.rollouts["r2"] = None  # type: ignore[assignment]
    older = _OlderGateway(gateway, 429)  # the gateway's cap of streams is reached

    async def handle(request: httpx.Request) -> httpx.Response:
        if older.refused:  # a stream was closed meanwhile: room again
            return await gateway.handle(request)
        return await older.handle(request)

    transport = httpx.MockTransport(handle)
    async with GatewayClient("http://gw.test:8000", transport=transport) as client:
        watcher = ExitWatcher(client, sleep=no_wait, coalesce=0)
        first = watcher.subscribe("r1")
        gateway.exit_board.report("r1", 0)
        assert await asyncio.wait_for(first, 2) == 0  # by the long-poll
        second = watcher.subscribe("r2")
        await _settle(lambda: len(gateway.exit_streams) == 1)
        gateway.exit_board.report("r2", 0)
        assert await asyncio.wait_for(second, 2) == 0
        assert watcher.streaming is True
        await watcher.aclose()
    assert older.refused == 1 and gateway.exit_stream_cursors == [1]


async def test_the_stream_closes_when_nobody_waits_and_on_aclose():
    gateway = FakeGateway()
    async with GatewayClient("http://gw.test:8000", transport=gateway.transport()) as client:
        watcher = ExitWatcher(client, sleep=no_wait)
        watcher.subscribe("r1")
        await _settle(lambda: len(gateway.exit_streams) == 1)
        watcher.unsubscribe("r1")
        await _settle(lambda: gateway.exit_streams == [])
        hint = watcher.subscribe("r2")
        await _settle(lambda: len(gateway.exit_streams) == 1)
        await watcher.aclose()
        assert gateway.exit_streams == [] and hint.cancelled()


async def test_the_long_poll_coalesces_a_burst_of_exits_into_few_polls():
    gateway = FakeGateway(exit_stream=False)
    ids = [f"r{i}" for i in range(20)]
    for rid in ids:
        gateway.rollouts[rid] = None  # type: ignore[assignment]
    pauses: list[float] = []

    async def pause(seconds: float) -> None:  # the coalescing window, made deterministic
        pauses.append(seconds)
        for rid in ids[1:]:
            gateway.exit_board.report(rid, 0)  # the rest of the burst exits meanwhile

    async with GatewayClient("http://gw.test:8000", transport=gateway.transport()) as client:
        watcher = ExitWatcher(client, sleep=pause, stream=False)
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
                assert forged.status_code == 404  # as if the rollout were unknown
                unauthenticated = await http.get(protocol.EXITS_PATH)
                assert unauthenticated.status_code == 401
            assert (await client.wait_exits(0, 0))["exits"] == []


def test_the_wrapper_without_reports_execs_the_agent():
    command = agent_launch_command("python agent.py", "/tmp/p", report_exit=False)
    assert "exec sh -c" in command and "exit_code" not in command
    assert os.path.basename("/tmp/p") in command
