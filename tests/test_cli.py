"""The ``rollout-gateway`` command as a user meets it: Ctrl-C, option errors in one line,
admin-token errors that name the fix, install commands that work (issue 35)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.servers import stop_group

from rollout_gateway import child_processes
from rollout_gateway.cli import EXIT_SIGINT, main
from rollout_gateway.verifiers_stack import install_command

ROOT = Path(__file__).resolve().parents[1]
UP = "http://127.0.0.1:8001/v1"
TOKEN = "cli-admin-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _running(*argv: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """``rollout-gateway ARGV`` in a child process, with SIGINT as a terminal delivers it
    (the default disposition: the child is not a background job ignoring it). Its own
    process group, dead with this process (even by ``kill -9``)."""
    proc = child_processes.spawn(
        [sys.executable, "-m", "rollout_gateway.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        stop_group(proc)  # anything it left in its group


def _wait_for(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} never answered")


@pytest.mark.parametrize("command", ["scripted-model", "serve"])
def test_ctrl_c_stops_a_server_cleanly_with_exit_130(command: str, tmp_path: Path) -> None:
    """A real SIGINT: the server shuts down (uvicorn says so), no traceback, and the exit
    status is 130 (128 + SIGINT), what a shell reports for a program Ctrl-C stopped."""
    port = _free_port()
    argv = [command, "--port", str(port)]
    env = {}
    if command == "serve":
        argv += ["--upstream", f"http://127.0.0.1:{_free_port()}/v1"]
        env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": TOKEN, "ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE": ""}
    ready = f"http://127.0.0.1:{port}/" + ("health/live" if command == "serve" else "v1/models")
    with _running(*argv, env=env) as proc:
        _wait_for(ready, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_SIGINT == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "Finished server process" in err


@pytest.mark.parametrize(
    "argv,says",
    [
        (
            ["serve", "--upstream", "127.0.0.1:8001/v1"],
            "argument --upstream: 127.0.0.1:8001/v1: not an http(s) URL (did you mean "
            "http://127.0.0.1:8001/v1?)",
        ),
        (["serve"], "the following arguments are required: --upstream"),
        (["serve", "--upstream", UP, "--port", "70000"], "--port: must be a port from 1 to"),
        (["serve", "--upstream", UP, "--bogus"], "unrecognized arguments: --bogus"),
        (["scripted-model", "--latency-ms", "-1"], "--latency-ms: must be a finite number >= 0"),
        (["bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_option_errors_are_one_line_with_where_to_look(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # no 25-line usage block
    assert says in line
    command = "rollout-gateway" + ("" if argv[0] == "bogus" else f" {argv[0]}")
    assert line.startswith(f"{command}: error: ")
    assert line.endswith(
        f"({command} --help lists the {'commands' if argv[0] == 'bogus' else 'options'})"
    )


@pytest.mark.parametrize("command", ["scripted-model", "serve"])
def test_a_port_in_use_is_one_line_naming_it(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    from rollout_gateway.server.ops import gc_tuning

    monkeypatch.setattr(gc_tuning, "tune_for_serving", lambda: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        extra = ["--upstream", f"http://127.0.0.1:{_free_port()}/v1"] if command == "serve" else []
        assert main([command, "--port", str(port), *extra]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"rollout-gateway {command}: error: --host 127.0.0.1 --port {port}: ")
    assert "choose another --port" in line


def _serve_error(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys) -> str:
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    assert main(["serve", "--upstream", UP, *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def test_admin_token_errors_name_the_fix_the_readme_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    line = _serve_error([], monkeypatch, capsys)
    assert "no admin token: add --admin-token-file PATH --create-admin-token" in line
    missing = tmp_path / "admin-token"
    line = _serve_error(["--admin-token-file", str(missing)], monkeypatch, capsys)
    assert f"--admin-token-file {missing}: cannot read the admin token file" in line
    assert line.endswith("add --create-admin-token to write a fresh one there (mode 0600)")
    # The fix works: the same options with it give a config with the token written there.
    from rollout_gateway.cli import build_parser, prepare_admin_token_file, serve_config

    args = build_parser().parse_args(
        ["serve", "--upstream", UP, "--admin-token-file", str(missing), "--create-admin-token"]
    )
    prepare_admin_token_file(args)
    assert serve_config(args).admin_token == missing.read_text().strip()
    short = tmp_path / "short"
    short.write_text("x\n")
    line = _serve_error(["--admin-token-file", str(short)], monkeypatch, capsys)
    assert "at least 16 chars; fix or remove it" in line  # never overwritten by a create


def test_the_admin_token_file_of_the_quickstart_is_ignored_by_git() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "admin-token"], cwd=ROOT, capture_output=True
    )
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, "admin-token (the quickstart's) is not in .gitignore"


@pytest.mark.parametrize("extra", ["v1", "classic"])
def test_the_install_command_a_message_gives_installs_from_here(extra: str) -> None:
    """rollout-gateway is not on a public index: the command names this checkout (an
    editable install, as the README's) with the extra, and that extra exists there."""
    command = install_command(extra)
    assert command == f"pip install -e '{ROOT}[{extra}]'"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "rollout-gateway" and extra in project["optional-dependencies"]
