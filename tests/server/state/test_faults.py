"""A state directory the gateway cannot use is refused at start (exit status 2, a clear
message); damage is found and reported with what was kept, never served; state of
another schema is refused, not misread; a store that fails mid-run fails the turn with a
503 and the gateway goes on from what the store holds once it can write again."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_gateway.cli import main
from rollout_gateway.server.state.sqlite import SQLiteStore
from rollout_gateway.server.state.sqlite_schema import SCHEMA_VERSION
from rollout_gateway.server.state.store import StoreUnavailableError

from ..conftest import ADMIN_TOKEN, RecordingUpstream
from .test_restart import ADMIN, Agent, running, tokens_of

UP = "http://127.0.0.1:9/v1"  # never reached: these gateways do not get as far


def serve(state_dir: Path | str, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
    return main(["serve", "--upstream", UP, "--port", "1", "--state-dir", str(state_dir)])


async def fill(directory: Path, rollouts: int = 3, turns: int = 2) -> dict[str, Any]:
    """A state directory with ``rollouts`` rollouts of ``turns`` turns; their trajectories."""
    app = RecordingUpstream().app()
    trajectories = {}
    async with running(app, SQLiteStore(directory)) as gw:
        for i in range(rollouts):
            r = await gw.post(f"/v1/rollouts/r{i}/register", json={"model": "m"}, headers=ADMIN)
            agent = Agent(r.json()["api_key"])
            agent.messages[0]["content"] = f"MARKER-r{i} " + agent.messages[0]["content"]
            for _ in range(turns):
                reply = await gw.post(
                    f"/v1/rollouts/r{i}/chat/completions",
                    json=agent.body(),
                    headers={"Authorization": f"Bearer {agent.key}"},
                )
                agent.take(reply.json())
            trajectory = await gw.get(f"/v1/rollouts/r{i}/trajectory", headers=ADMIN)
            trajectories[f"r{i}"] = trajectory.json()
    return trajectories


# -- refused at start ------------------------------------------------------------------------


def test_a_state_dir_that_cannot_be_made_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "file").write_text("not a directory")
    assert serve(tmp_path / "file" / "state", monkeypatch) == 2
    err = capsys.readouterr().err
    assert "--state-dir" in err and "Not a directory" in err


def test_state_sync_without_a_state_dir_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
    assert main(["serve", "--upstream", UP, "--state-sync", "full"]) == 2
    assert "--state-sync: only with --state-dir" in capsys.readouterr().err


def test_a_database_that_cannot_be_opened_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "state" / "state.db").mkdir(parents=True)  # in its place: a directory
    assert serve(tmp_path / "state", monkeypatch) == 2
    assert "unable to open database file" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_state_dir_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o500)
    try:
        assert serve(state, monkeypatch) == 2
    finally:
        state.chmod(0o700)
    assert "--state-dir" in capsys.readouterr().err


def test_a_full_disk_at_start_is_refused(tmp_path: Path) -> None:
    """The gateway process may write no more than 4 KiB to any file (``RLIMIT_FSIZE``:
    the kernel fails its writes as on a full disk)."""

    def limit_writes() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    done = subprocess.run(
        [sys.executable, "-m", "rollout_gateway.cli", "serve", "--upstream", UP, "--port", "1",
         "--state-dir", str(tmp_path / "state")],
        env=env, preexec_fn=limit_writes, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--state-dir" in done.stderr and "is the disk full?" in done.stderr


async def test_a_state_dir_in_use_by_another_gateway_is_refused(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    holder = SQLiteStore(tmp_path / "state")
    await holder.open()
    try:
        assert await asyncio.to_thread(serve, tmp_path / "state", monkeypatch) == 2
        assert "in use by another gateway" in capsys.readouterr().err
    finally:
        await holder.close()


async def test_state_of_another_schema_is_refused_not_misread(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    await fill(tmp_path / "state", rollouts=1, turns=1)
    conn = sqlite3.connect(tmp_path / "state" / "state.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    assert await asyncio.to_thread(serve, tmp_path / "state", monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"schema version {SCHEMA_VERSION + 1}" in err and "another version" in err


def test_a_database_of_something_else_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "state").mkdir()
    conn = sqlite3.connect(tmp_path / "state" / "state.db")
    conn.execute("CREATE TABLE notes (text TEXT)")
    conn.commit()
    conn.close()
    assert serve(tmp_path / "state", monkeypatch) == 2
    assert "not a rollout-gateway state database" in capsys.readouterr().err


# -- damage found and reported -------------------------------------------------------------


def _flip(path: Path, marker: bytes) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(marker)
    assert at >= 0, f"{marker!r} not in {path}"
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _first_step(path: Path, rollout_id: str) -> bytes:
    """The stored bytes of a rollout's first step (its messages are deflated: no marker
    text is found in the file as such)."""
    conn = sqlite3.connect(path)
    try:
        (body,) = conn.execute(
            "SELECT body FROM steps JOIN rollouts ON steps.rollout = rollouts.id "
            "WHERE rollouts.rollout_id = ? AND idx = 0",
            (rollout_id,),
        ).fetchone()
    finally:
        conn.close()
    return bytes(body)[-40:-8]  # the end of its messages, before the checksum


async def test_a_damaged_record_drops_its_rollout_and_keeps_the_others(
    tmp_path: Path, caplog
) -> None:
    before = await fill(tmp_path / "state")
    database = tmp_path / "state" / "state.db"
    _flip(database, _first_step(database, "r1"))  # inside r1's first step
    caplog.set_level(logging.ERROR, logger="rollout_gateway.server")
    async with running(RecordingUpstream().app(), SQLiteStore(tmp_path / "state")) as gw:
        assert (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).status_code == 404
        for kept in ("r0", "r2"):
            after = (await gw.get(f"/v1/rollouts/{kept}/trajectory", headers=ADMIN)).json()
            assert tokens_of(after) == tokens_of(before[kept])
    assert any(
        "rollout r1 is damaged" in r.message and "checksum mismatch" in r.message
        and "dropped, not served" in r.message
        for r in caplog.records
    )  # fmt: skip


async def test_a_truncated_database_is_salvaged_and_reported(tmp_path: Path, caplog) -> None:
    before = await fill(tmp_path / "state", rollouts=40, turns=2)
    path = tmp_path / "state" / "state.db"
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size * 2 // 3)
    caplog.set_level(logging.ERROR, logger="rollout_gateway.server")
    async with running(RecordingUpstream().app(), SQLiteStore(tmp_path / "state")) as gw:
        served = 0
        for rollout_id, trajectory in before.items():
            r = await gw.get(f"/v1/rollouts/{rollout_id}/trajectory", headers=ADMIN)
            if r.status_code == 200:  # what is served is exactly what was recorded
                assert tokens_of(r.json()) == tokens_of(trajectory)
                served += 1
            else:
                assert r.status_code == 404
        health = (await gw.get("/health", headers=ADMIN)).json()
    messages = " | ".join(r.message for r in caplog.records)
    assert "the state database was damaged" in messages
    assert f"recovered {served} rollouts" in messages
    assert served < len(before)
    assert f"lost {len(before) - served} rollouts" in messages
    assert health["active_rollouts"] == served
    assert list((tmp_path / "state").glob("state.db.damaged-*"))  # kept for a look


async def test_a_file_that_is_not_a_database_is_set_aside(tmp_path: Path, caplog) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.db").write_bytes(b"garbage" * 1000)
    caplog.set_level(logging.ERROR, logger="rollout_gateway.server")
    async with running(RecordingUpstream().app(), SQLiteStore(tmp_path / "state")) as gw:
        r = await gw.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        assert r.status_code == 200  # a fresh database serves
    assert "recovered 0 rollouts" in " | ".join(r.message for r in caplog.records)
    assert list((tmp_path / "state").glob("state.db.damaged-*"))


# -- failing mid-run -----------------------------------------------------------------------


async def test_a_store_failing_mid_run_is_a_503_then_the_rollout_goes_on(tmp_path: Path) -> None:
    """SQLite's own "database or disk is full" (its page budget capped on the writer's
    connection): the turn is refused 503 (the SDK retries it), nothing half-written is
    kept, and once the store can write the retry runs the turn once."""
    upstream = RecordingUpstream()
    store = SQLiteStore(tmp_path / "state")
    async with running(upstream.app(), store) as gw:
        r = await gw.post("/v1/rollouts/r1/register", json={"model": "m"}, headers=ADMIN)
        agent = Agent(r.json()["api_key"])
        agent.messages[0]["content"] += " " + "x" * 200_000  # a turn bigger than what is left
        writer: Any = store._writer

        def cap(pages: int | None) -> Any:
            def write(conn: sqlite3.Connection) -> None:
                count = conn.execute("PRAGMA page_count").fetchone()[0]
                conn.execute(f"PRAGMA max_page_count = {pages or count + 1}")

            return writer.submit(write)

        await cap(None)
        full = await agent.turn(gw)
        assert full.status_code == 503, full.text
        assert full.json()["error"]["code"] == "store_unavailable"
        assert (await agent.turn(gw, {"x-stainless-retry-count": "1"})).status_code == 503
        await cap(1 << 30)
        retried = await agent.turn(gw, {"x-stainless-retry-count": "2"})
        assert retried.status_code == 200
        trajectory = (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert trajectory["num_turns"] == 1  # the refused attempts left nothing behind
    async with running(upstream.app(), SQLiteStore(tmp_path / "state")) as gw:
        again = (await gw.get("/v1/rollouts/r1/trajectory", headers=ADMIN)).json()
        assert tokens_of(again) == tokens_of(trajectory)


async def test_a_closed_store_refuses_writes_as_unavailable(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state")
    await store.open()
    await store.close()
    with pytest.raises(StoreUnavailableError):
        await store.save_rollout("r1", {})
