"""``rollout-gateway demo`` as a tool: results as they finish, metadata, checks before any
sandbox starts, clean stops on SIGINT / SIGTERM, ``--resume``, help and version."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollout_gateway.cli import build_parser, main
from rollout_gateway.demo.preflight import check_upstream
from rollout_gateway.demo.results import compact


@pytest.fixture
def sandbox_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT", str(root))
    return root


def read_results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_demo_runs_the_example_and_writes_results_and_metadata(
    tmp_path: Path, sandbox_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["demo", "--examples", "2", "--rollouts-per-example", "1", "--temperature", "0"]
    code = main([*args, "--output", str(out), "--timeout", "120"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "status       completed" in printed and str(out / "results.jsonl") in printed
    assert "isolation=" in printed
    rows = read_results(out)
    assert sorted((r["example_id"], r["rollout_index"]) for r in rows) == [(0, 0), (1, 0)]
    for row in rows:
        assert row["error"] is None
        assert row["sandbox_isolation"] in ("bwrap", "unshare", "uid")
        assert row["reward"] == 1.0  # temperature 0: the scripted fix is the right one
        for step in row["trajectory"]:
            tokens = step["tokens"]
            assert tokens["prompt_ids"] and tokens["completion_ids"]
            assert len(tokens["completion_logprobs"]) == len(tokens["completion_ids"])
            # Each token list is stored once (not again under response.message).
            assert "tokens" not in (step.get("response") or {}).get("message", {})
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["status"] == "completed"
    assert meta["counts"] == {"total": 2, "done": 2, "failed": 0, "pending": 0, "mean_reward": 1.0}
    assert meta["env_id"] == "rollout_gateway.examples.fix_bug_env"
    assert meta["model"] == "scripted" and meta["isolation"] in ("bwrap", "unshare", "uid")
    assert meta["versions"]["verifiers"] == "0.3.1"
    assert meta["options"]["examples"] == 2 and meta["duration_s"] > 0
    assert not sandbox_root.exists() or list(sandbox_root.iterdir()) == []


def test_compact_keeps_each_token_list_once() -> None:
    tokens = {"prompt_ids": [1, 2], "completion_ids": [3], "completion_logprobs": [-0.1]}
    record = {
        "trajectory": [
            {"tokens": dict(tokens), "response": {"message": {"tokens": dict(tokens)}}},
            {"tokens": dict(tokens), "response": {"message": {"tokens": {"prompt_ids": [9]}}}},
        ]
    }
    steps = compact(record)["trajectory"]
    assert "tokens" not in steps[0]["response"]["message"] and steps[0]["tokens"] == tokens
    assert steps[1]["response"]["message"]["tokens"] == {"prompt_ids": [9]}  # differs: kept


def test_bad_output_fails_before_any_sandbox(
    tmp_path: Path, sandbox_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "results.jsonl").write_text("{}\n")
    assert main(["demo", "--output", str(taken)]) == 2
    assert "--resume" in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["demo", "--output", str(blocker / "sub")]) == 2
    assert "cannot create the output directory" in capsys.readouterr().out
    assert main(["demo", "--resume", str(tmp_path / "missing")]) == 2
    assert "no metadata.json" in capsys.readouterr().out
    assert not sandbox_root.exists()  # no sandbox was ever created


async def test_upstream_that_is_not_an_openai_api_gets_a_clear_message() -> None:
    def web_server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="<html>not found</html>")

    with pytest.raises(Exception, match="is up but is not an OpenAI-compatible API"):
        await check_upstream(
            "http://upstream.test/v1", "m", transport=httpx.MockTransport(web_server)
        )

    def models(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"object": "list", "data": [{"id": "qwen"}]})

    transport = httpx.MockTransport(models)
    await check_upstream("http://upstream.test/v1", "qwen", transport=transport)
    with pytest.raises(Exception, match="does not serve model 'other'; it serves: qwen"):
        await check_upstream("http://upstream.test/v1", "other", transport=transport)

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with pytest.raises(Exception, match="cannot reach the upstream"):
        await check_upstream("http://upstream.test/v1", "m", transport=httpx.MockTransport(down))


def test_demo_against_a_non_openai_server_exits_with_the_reason(
    tmp_path: Path, sandbox_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from starlette.applications import Starlette

    from rollout_gateway.server.runner import server_thread

    with server_thread(Starlette()) as root:  # up, but answers 404 to everything
        code = main(
            ["demo", "--upstream", f"{root}/v1", "--model", "m", "--output", str(tmp_path / "o")]
        )
    printed = capsys.readouterr().out
    assert code == 2
    assert "is up but is not an OpenAI-compatible API" in printed and "404" in printed
    assert not sandbox_root.exists()


def test_demo_refuses_bad_options_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--upstream", "http://127.0.0.1:9/v1"]) == 2
    assert "--upstream needs --model" in capsys.readouterr().out


@pytest.mark.parametrize(
    "option,value", [("--timeout", "nan"), ("--temperature", "-1"), ("--temperature", "nan")]
)
def test_demo_refuses_non_numbers_naming_the_option(
    option: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--output", str(tmp_path / "out"), option, value]) == 2
    assert option in capsys.readouterr().out


def test_every_option_has_help_and_there_is_a_version(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help text"
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("rollout-gateway ")
    help_text = subparsers.choices["demo"].format_help()
    assert "bwrap" in help_text and "process-group" in help_text and "results.jsonl" in help_text
    for text in [parser.format_help(), *(sub.format_help() for sub in subparsers.choices.values())]:
        assert "``" not in text  # docstring markup never reaches a user's terminal


def start_demo(out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "rollout_gateway.cli", "demo", "--output", str(out)]
    command += ["--examples", "2", "--rollouts-per-example", "2", "--concurrency", "1"]
    return subprocess.Popen(
        [*command, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def wait_for_results(out: Path, at_least: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 90
    path = out / "results.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= at_least:
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise AssertionError("no result written in time")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_stops_cleanly_and_resume_finishes_the_run(
    tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "run"
    root = tmp_path / "sandboxes"
    env = {**os.environ, "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT": str(root)}
    proc = start_demo(out, env)
    try:
        wait_for_results(out, 1, proc)
        proc.send_signal(sig)
        printed, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, printed
    assert "Traceback" not in printed
    assert f"interrupted ({sig.name} received)" in printed
    assert f"resume with  rollout-gateway demo --resume {out}" in printed
    kept = read_results(out)
    assert 1 <= len(kept) < 4
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["status"] == "interrupted" and meta["counts"]["done"] == len(kept)
    assert list(root.iterdir()) == []  # in-flight sandboxes removed

    resumed = subprocess.run(
        [sys.executable, "-m", "rollout_gateway.cli", "demo", "--resume", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming: {len(kept)} finished, {4 - len(kept)} to run" in resumed.stdout
    rows = read_results(out)
    keys = sorted((r["example_id"], r["rollout_index"]) for r in rows)
    assert keys == [(e, i) for e in range(2) for i in range(2)]  # each once, none again
    assert json.loads((out / "metadata.json").read_text())["status"] == "completed"


def test_timeout_keeps_finished_results(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT": str(tmp_path / "sb")}
    done = subprocess.run(
        [sys.executable, "-m", "rollout_gateway.cli", "demo", "--output", str(out)]
        + ["--examples", "1", "--rollouts-per-example", "1", "--timeout", "0.5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "timed_out (--timeout 0.5 s reached)" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert json.loads((out / "metadata.json").read_text())["status"] == "timed_out"


def test_progress_bar_on_a_terminal_and_plain_lines_elsewhere() -> None:
    import io

    from rollout_gateway.demo.progress import ProgressView

    ok = {"example_id": 0, "rollout_index": 0, "reward": 1.0, "error": None, "trajectory": []}
    failed = {**ok, "rollout_index": 1, "reward": 0.0, "error": {"error": "E", "message": "x"}}
    screen = io.StringIO()
    with ProgressView(screen, total=2, terminal=True) as view:
        view.finished(ok, verbose=False)
        view.finished(failed, verbose=False)
    shown = screen.getvalue()
    assert "2/2" in shown and "failed 1" in shown and "mean reward 0.500" in shown

    log = io.StringIO()
    with ProgressView(log, total=2, terminal=False) as view:
        view.finished(ok, verbose=False)
        view.finished(failed, verbose=False)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\x1b" not in log.getvalue()
    assert lines[1].startswith("[2/2]") and "failed=1" in lines[1] and "error=E: x" in lines[1]

    long_error = {**failed, "error": {"error": "SandboxError", "message": "y" * 300}}
    table = io.StringIO()
    ProgressView(table, total=1, terminal=False).summary([long_error], [("status", "done")])
    assert table.getvalue().count("y") == 300  # wrapped, never cut off


def test_uid_modes_refuse_a_python_the_sandbox_uid_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil
    import tempfile

    from rollout_gateway.local_sandbox import unavailable_reasons

    real = Path(os.path.realpath(sys.executable))
    if unavailable_reasons()["uid"] is not None:
        pytest.skip("isolation uid unavailable here")
    if all(os.stat(p).st_mode & 0o001 for p in real.parents):
        pytest.skip(f"{real} is reachable by other users here")
    base = Path(tempfile.mkdtemp(prefix="rg-demo-", dir="/tmp"))  # reachable by any uid
    os.chmod(base, 0o711)
    sandbox_root = base / "sandboxes"
    monkeypatch.setenv("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT", str(sandbox_root))
    try:
        assert main(["demo", "--isolation", "uid", "--output", str(tmp_path / "o")]) == 2
        assert "install bubblewrap" in capsys.readouterr().out
        assert not sandbox_root.exists() or list(sandbox_root.iterdir()) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
