"""The admin token: its file (serve creates it, the env reads it) and a refused token as a
configuration error, raised once, before any sandbox starts, naming the setting."""

from __future__ import annotations

import asyncio
import os
import stat
from collections import Counter
from pathlib import Path

import httpx
import pytest
from core_world import GATEWAY_URL, World
from support.servers import stop_group

from rollout_gateway import child_processes
from rollout_gateway.admin_token import (
    AdminTokenFileError,
    create_admin_token_file,
    read_admin_token_file,
)
from rollout_gateway.client import GatewayClient
from rollout_gateway.errors import GatewayAuthError, GatewayConfigError, GatewayUnavailableError
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.settings import GatewaySettings

TOKEN = "a-token-of-more-than-sixteen-chars"


# --------------------------------------------------------------------------- the file


def test_a_created_token_file_is_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "admin-token"
    old_umask = os.umask(0)  # the file is 0600 whatever the umask
    try:
        assert create_admin_token_file(path) is True
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = read_admin_token_file(path)
    assert len(token) >= 40
    assert create_admin_token_file(path) is False  # an existing file is never replaced
    assert read_admin_token_file(path) == token


def test_an_unreadable_or_empty_token_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(AdminTokenFileError, match="cannot read the admin token file"):
        read_admin_token_file(tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(GatewayConfigError, match="empty"):
        read_admin_token_file(tmp_path / "empty")


def test_the_env_reads_the_token_from_the_file_its_variable_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", "from-the-variable-itself-0123")
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", str(path))
    assert GatewaySettings().resolved_admin_token() == TOKEN  # the file wins, as in serve
    assert GatewaySettings(admin_token="explicit").resolved_admin_token() == "explicit"
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(GatewayConfigError, match=r"\$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE"):
        GatewaySettings().resolved_admin_token()


# --------------------------------------------------------------------------- the client


class Counting:
    """A gateway answering every call with one status; counts what reached it."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.calls: Counter[str] = Counter()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls[request.url.path.rsplit("/", 1)[-1]] += 1
        await asyncio.sleep(0.01)  # the answer takes a while: callers pile up behind it
        error = {"message": "missing or invalid admin token", "type": "unauthorized"}
        return httpx.Response(self.status, json={"error": error})


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_token_fails_a_burst_once_with_the_setting_to_fix(status: int) -> None:
    gateway = Counting(status)
    client = GatewayClient(
        GATEWAY_URL,
        transport=httpx.MockTransport(gateway.handle),
        auth_help=GatewaySettings().admin_token_help(),
    )
    results = await asyncio.gather(
        *(client.register(f"r{i}", model="m") for i in range(20)), return_exceptions=True
    )
    assert all(isinstance(r, GatewayAuthError) for r in results)
    assert gateway.calls == Counter(register=1)  # one request; never retried
    message = str(results[0])
    print(message)
    assert f"{status} missing or invalid admin token" in message
    assert "the env sent no admin token" in message
    assert "$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE" in message
    with pytest.raises(GatewayAuthError):
        await client.unregister("r0")  # later calls too, without reaching the gateway
    assert gateway.calls == Counter(register=1)
    await client.aclose()


def test_a_wrong_token_message_says_where_the_env_took_it_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", "not-the-gateway-token-0123")
    assert (
        GatewaySettings()
        .admin_token_help()
        .startswith("the admin token in $ROLLOUT_GATEWAY_ADMIN_TOKEN is not the gateway's")
    )


async def test_a_first_call_that_gets_no_answer_does_not_hold_the_others() -> None:
    answers = iter([httpx.ConnectError("refused"), None, None])

    async def handle(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if answer is not None:
            raise answer
        return httpx.Response(200, json={"rollout_id": "r", "status": "cancelled"})

    client = GatewayClient(GATEWAY_URL, transport=httpx.MockTransport(handle))
    client.retry = client.retry.__class__(max_attempts=1)
    first, second = await asyncio.gather(
        client.cancel("r1"), client.cancel("r2"), return_exceptions=True
    )
    assert isinstance(first, GatewayUnavailableError)
    assert second == {"rollout_id": "r", "status": "cancelled"}
    await client.aclose()


async def test_check_admin_token_raises_only_a_refusal() -> None:
    for status, refused in ((404, False), (401, True), (503, False)):
        client = GatewayClient(GATEWAY_URL, transport=httpx.MockTransport(Counting(status).handle))
        if refused:
            with pytest.raises(GatewayAuthError):
                await client.check_admin_token()
        else:
            await client.check_admin_token()
        await client.aclose()


# ------------------------------------------------------------------------ the lifecycle


async def test_a_refused_register_raises_before_any_sandbox_and_leaves_nothing() -> None:
    world = World()
    world.gateway.fail("register", 401)
    runs = [world.rollout() for _ in range(5)]
    results = await asyncio.gather(
        *(rollout.execute(hooks) for rollout, hooks in runs), return_exceptions=True
    )
    assert all(isinstance(r, GatewayAuthError) for r in results), results
    assert world.gateway.op_counts == Counter(register=1)  # no unregister, no retry
    assert world.sandboxes.sandboxes == {}  # no sandbox was ever created
    for rollout, hooks in runs:
        assert "score" not in hooks.ran and "launch" not in hooks.ran
        assert isinstance(rollout.record.error, GatewayAuthError)
    assert world.leaks()["registered"] == [] and world.leaks()["sandboxes"] == []
    await world.resources.aclose()


# --------------------------------------------------------------------- a real gateway


async def test_the_reference_gateway_refuses_an_env_without_its_token() -> None:
    config = GatewayConfig(upstreams=["http://127.0.0.1:9/v1"], admin_token=TOKEN)
    async with running_server(create_app(config)) as root:
        anonymous = GatewayClient(root)
        with pytest.raises(GatewayAuthError, match="401 missing or invalid admin token"):
            await anonymous.check_admin_token()
        await anonymous.aclose()
        admitted = GatewayClient(root, admin_token=TOKEN)
        await admitted.check_admin_token()  # 404 for the random id: the token works
        await admitted.aclose()


# ------------------------------------------------------------------- serve creates it


def test_serve_creates_the_token_file_says_where_and_serves_with_it(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "admin-token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_GATEWAY_ADMIN")}
    serve = child_processes.spawn(  # its own group, dead with this process
        [sys.executable, "-m", "rollout_gateway.cli", "serve", "--port", str(port),
         "--upstream", "http://127.0.0.1:9/v1", "--admin-token-file", str(path),
         "--create-admin-token"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert serve.stderr is not None
        notice = serve.stderr.readline()
        assert notice.startswith(
            f"rollout-gateway serve: admin token written to {path} (mode 0600)"
        )
        assert f"ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE={path}" in notice
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = read_admin_token_file(path)
        deadline = time.monotonic() + 60
        while True:
            try:
                answer = httpx.get(
                    f"http://127.0.0.1:{port}/metrics",
                    headers={"Authorization": f"Bearer {token}"},
                )
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "serve did not start"
                time.sleep(0.2)
        assert answer.status_code == 200
    finally:
        stop_group(serve, grace_s=30)


def test_create_admin_token_needs_a_file_and_names_the_option(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_gateway import cli

    monkeypatch.delenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", raising=False)
    argv = ["serve", "--upstream", "http://127.0.0.1:9/v1", "--create-admin-token"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "rollout-gateway serve: error: --create-admin-token: name the file to write with "
        "--admin-token-file PATH (or $ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE)"
    )


def test_an_existing_token_file_is_kept_and_a_loose_one_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from rollout_gateway import cli

    path = tmp_path / "admin-token"
    path.write_text(TOKEN)
    path.chmod(0o644)
    args = argparse.Namespace(admin_token_file=str(path), create_admin_token=True)
    notice = cli.prepare_admin_token_file(args)
    assert notice is not None
    assert notice.startswith(f"admin token read from {path} (it exists: kept)")
    assert f"warning: the admin token file {path} is readable by other users" in notice
    assert read_admin_token_file(path) == TOKEN
