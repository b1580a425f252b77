"""``rollout-gateway demo`` end to end on the installed verifiers stack (both stacks run
this module): results as they finish, metadata, signals and resume, Ctrl-C during setup,
infra failures run again, a closed output pipe, a dead upstream.

The core's logic is pinned down with a fake stack in ``test_demo_core.py``; what only one
stack writes is in ``test_demo_classic.py`` / ``test_demo_v1.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from stacks import STACK

from rollout_gateway import child_processes
from rollout_gateway.cli import main
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server.runner import server_thread

pytestmark = pytest.mark.skipif(STACK == "none", reason="needs a verifiers stack")

#: What each stack writes besides metadata.json.
LAYOUT = {
    "classic": {"metadata.json", "results.jsonl"},
    "v1": {
        "metadata.json",
        "traces.jsonl",
        "configs/resolved/eval.json",
        "logs/attempt_1/eval.log",  # and logs/latest, a link to attempt_1
    },
}


def stored(out: Path) -> list[dict[str, Any]]:
    """The rollouts the run directory holds: (example, rollout, reward, failed) each."""
    if STACK == "classic":
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        return [
            {
                "key": (r["example_id"], r["rollout_index"]),
                "reward": r["reward"],
                "failed": r["error"] is not None,
            }
            for r in rows
        ]
    from rollout_gateway.v1.demo import V1Stack

    return [
        {"key": (s.example_id, s.rollout_index), "reward": s.reward, "failed": s.failed}
        for s in V1Stack().stored(out)
    ]


def metadata(out: Path) -> dict[str, Any]:
    return json.loads((out / "metadata.json").read_text())


def files(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}


@pytest.fixture
def sandbox_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT", str(root))
    return root


def demo_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT": str(tmp_path / "sandboxes")}


def test_demo_runs_the_example_and_writes_the_stacks_run_directory(
    tmp_path: Path, sandbox_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["demo", "--examples", "2", "--rollouts-per-example", "1", "--temperature", "0"]
    code = main([*args, "--output", str(out), "--timeout", "150"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "status         completed" in printed and f"run directory  {out}/" in printed
    assert f"stack           {STACK}" in printed
    rows = stored(out)
    assert sorted(r["key"] for r in rows) == [(0, 0), (1, 0)]
    assert all(r["reward"] == 1.0 and not r["failed"] for r in rows)  # temperature 0
    assert files(out) == LAYOUT[STACK]
    if STACK == "v1":
        assert (out / "logs" / "latest").resolve() == out / "logs" / "attempt_1"
    meta = metadata(out)
    assert meta["status"] == "completed" and meta["stack"] == STACK
    assert meta["counts"] == {"total": 2, "done": 2, "failed": 0, "pending": 0, "mean_reward": 1.0}
    assert meta["options"]["examples"] == 2 and meta["duration_s"] > 0
    assert not sandbox_root.exists() or list(sandbox_root.iterdir()) == []


def test_a_dead_upstream_is_refused_at_once_with_nothing_created(
    tmp_path: Path, sandbox_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    out = tmp_path / "run"
    code = main(
        ["demo", "--upstream", "http://127.0.0.1:9/v1", "--model", "m"] + ["--output", str(out)]
    )
    took = time.monotonic() - started
    assert code == 2
    assert "cannot reach the upstream http://127.0.0.1:9/v1" in capsys.readouterr().err
    assert took < 30, took  # refused, never run
    assert not out.exists() and not sandbox_root.exists()


def test_an_upstream_that_is_not_an_openai_api_is_refused(
    tmp_path: Path, sandbox_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from starlette.applications import Starlette

    with server_thread(Starlette()) as root:  # up, but answers 404 to everything
        code = main(
            ["demo", "--upstream", f"{root}/v1", "--model", "m", "--output", str(tmp_path / "o")]
        )
    err = capsys.readouterr().err
    assert code == 2
    assert "is up but is not an OpenAI-compatible API" in err and "404" in err
    assert not (tmp_path / "o").exists() and not sandbox_root.exists()


def start_demo(out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "rollout_gateway.cli", "demo", "--output", str(out)]
    command += ["--examples", "2", "--rollouts-per-example", "2", "--concurrency", "1"]
    return child_processes.spawn(  # its own group, dead with this process (even kill -9)
        [*command, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def read_until(proc: subprocess.Popen[str], prefix: str) -> str:
    """The demo's output up to (and with) the first line starting with ``prefix``."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return "".join(seen)
    raise AssertionError(f"no line starting with {prefix!r} in:\n{''.join(seen)}")


def wait_for_results(out: Path, at_least: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if (out / "metadata.json").exists() and metadata(out)["counts"]["done"] >= at_least:
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise AssertionError("no result written in time")


def resume(out: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout_gateway.cli", "demo", "--resume", str(out), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_stops_cleanly_and_resume_finishes_the_run(
    tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "run"
    env = demo_env(tmp_path)
    proc = start_demo(out, env)
    try:
        wait_for_results(out, 1, proc)
        proc.send_signal(sig)
        printed, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, printed
    assert "Traceback" not in printed
    assert f"interrupted ({sig.name} received)" in printed
    assert f"resume with    rollout-gateway demo --resume {out}" in printed
    kept = stored(out)
    assert 1 <= len(kept) < 4
    meta = metadata(out)
    assert meta["status"] == "interrupted" and meta["counts"]["done"] == len(kept)
    assert not (tmp_path / "sandboxes").exists() or list((tmp_path / "sandboxes").iterdir()) == []

    resumed = resume(out, env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming: {len(kept)} finished, {4 - len(kept)} to run" in resumed.stdout
    keys = sorted(r["key"] for r in stored(out))
    assert keys == [(e, i) for e in range(2) for i in range(2)]  # each once, none again
    final = metadata(out)
    assert final["status"] == "completed" and final["started_at"] == meta["started_at"]
    assert len(final["resumes"]) == 1 and final["resumes"][0]["to_run"] == 4 - len(kept)

    again = resume(out, env)  # a finished run: nothing is started again
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to resume" in again.stdout and "rollout gateway" not in again.stdout
    assert metadata(out) == final


def test_ctrl_c_during_setup_stops_at_once_and_leaves_a_resumable_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_demo(out, demo_env(tmp_path))
    try:
        read_until(proc, "results ")  # the run directory exists: setup starts now
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        printed, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, printed
    print(f"Ctrl-C during setup: exited {took:.2f} s after the signal")
    assert took < 5, took  # the target is 1 s; generous for a loaded machine
    assert "Traceback" not in printed and "running 4 rollouts" not in printed
    meta = metadata(out)
    assert meta["status"] == "interrupted" and meta["counts"]["done"] == 0


def test_rollouts_that_failed_for_infra_reasons_run_again_on_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = demo_env(tmp_path)
    app = create_scripted_model_app()
    with server_thread(app) as root:
        port = int(root.rsplit(":", 1)[1])
        proc = start_demo(out, env, "--upstream", f"{root}/v1", "--model", "scripted")
        read_until(proc, "results ")  # preflight passed: the upstream was up
    # The upstream is gone for every rollout.
    printed, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, printed
    assert metadata(out)["counts"]["failed"] == 4
    assert all(r["failed"] for r in stored(out))

    with server_thread(create_scripted_model_app(), port=port):  # the upstream is back
        kept = resume(out, env, "--keep-failed")  # they stay failed, nothing runs
        assert kept.returncode == 1 and "nothing to resume" in kept.stdout
        done = resume(out, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming: 0 finished, 4 to run" in done.stdout
    rows = stored(out)
    assert len(rows) == 4 and not any(r["failed"] for r in rows)
    assert metadata(out)["counts"]["failed"] == 0


def test_piped_to_head_the_run_still_ends_with_a_final_status(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_demo(out, demo_env(tmp_path))
    assert proc.stdout is not None
    read_until(proc, "results ")
    proc.stdout.close()  # the reader went away, as head does after its lines
    proc.wait(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE
    meta = metadata(out)
    assert meta["status"] == "interrupted" and meta["stopped_by"] == "SIGPIPE"
    assert "pid" not in meta


def test_uid_modes_refuse_a_python_the_sandbox_uid_cannot_run() -> None:
    from rollout_gateway.demo.options import DemoError
    from rollout_gateway.demo.preflight import probe_isolation
    from rollout_gateway.local_sandbox import unavailable_reasons

    real = Path(os.path.realpath(sys.executable))
    if unavailable_reasons()["uid"] is not None:
        pytest.skip("isolation uid unavailable here")
    if all(os.stat(p).st_mode & 0o001 for p in real.parents):
        pytest.skip(f"{real} is reachable by other users here")
    with pytest.raises(DemoError, match="cannot run this Python"):
        probe_isolation("uid")
