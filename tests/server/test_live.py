"""Live uvicorn servers on loopback (port 0): the runner helpers and the CLI parser."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.local_cluster import free_port as _free_port
from support.servers import serving

from rollout_gateway.cli import build_parser, main
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app, running_server, server_thread

from .conftest import script

ADMIN = "live-admin-token-0123456789"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


async def test_end_to_end_over_real_http() -> None:
    model_app = create_scripted_model_app(latency_ms=5)
    async with running_server(model_app) as model_root:
        assert model_root.startswith("http://127.0.0.1:") and not model_root.endswith(":0")
        config = GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=ADMIN)
        async with running_server(create_app(config)) as root:
            async with httpx.AsyncClient(base_url=root, headers=ADMIN_HEADERS) as control:
                r = await control.post("/v1/rollouts/live1/register", json={"model": "m"})
                key = r.json()["api_key"]
                agent = openai.AsyncOpenAI(
                    base_url=f"{root}/v1/rollouts/live1", api_key=key, max_retries=0
                )
                messages = [{"role": "user", "content": script({"say": "over the wire"})}]
                stream = await agent.chat.completions.create(
                    model="m", messages=messages, stream=True
                )
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
                assert text == "over the wire"
                await agent.close()
                traj = (await control.get("/v1/rollouts/live1/trajectory")).json()
                assert traj["num_turns"] == 1 and traj["trajectory"][0]["tokens"] is not None
                assert (await control.get("/health")).json()["status"] == "ok"


def test_server_thread_from_sync_code() -> None:
    with server_thread(create_scripted_model_app()) as root:
        r = httpx.get(f"{root}/v1/models")
        assert r.status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{root}/v1/models")


async def test_running_server_reports_startup_failure() -> None:
    async with running_server(create_scripted_model_app()) as root:
        port = int(root.rsplit(":", 1)[1])
        with pytest.raises(RuntimeError, match="failed to start"):
            async with running_server(create_scripted_model_app(), port=port):
                pass


def test_cli_parses_serve_and_scripted_model() -> None:
    args = build_parser().parse_args(
        [
            "serve", "--upstream", "http://a:1/v1", "--upstream", "http://b:2/v1",
            "--port", "9000", "--no-rollout-keys", "--admin-token-file", "/tok",
            "--rollout-ttl", "60", "--max-rollouts", "5", "--upstream-timeout", "30",
            "--max-body-bytes", "1000", "--disabled",
        ]
    )  # fmt: skip
    # Each flag lands on the settings field that declares it.
    assert args.upstreams == ["http://a:1/v1", "http://b:2/v1"]
    assert (args.port, args.require_rollout_keys, args.admin_token_file) == (9000, False, "/tok")
    assert (args.rollout_ttl_s, args.max_rollouts, args.upstream_timeout_s) == (60.0, 5, 30.0)
    assert (args.max_body_bytes, args.enabled) == (1000, False)
    args = build_parser().parse_args(["scripted-model", "--latency-ms", "20"])
    assert (args.port, args.latency_ms, args.model_name) == (8001, 20.0, "scripted")
    with pytest.raises(SystemExit) as exc:
        main(["serve"])  # --upstream is required
    assert exc.value.code == 2


@contextlib.contextmanager
def _cli(*args: str, ready_url: str, env: dict[str, str] | None = None) -> Iterator[None]:
    cmd = [sys.executable, "-m", "rollout_gateway.cli", *args, "--log-level", "warning"]
    with serving(cmd, ready_url, env=env, stdout=None):  # dead with this process
        yield


def test_cli_processes_end_to_end() -> None:
    model_port, gateway_port = _free_port(), _free_port()
    model = f"http://127.0.0.1:{model_port}"
    root = f"http://127.0.0.1:{gateway_port}"
    with (
        _cli("scripted-model", "--port", str(model_port), ready_url=f"{model}/v1/models"),
        _cli(
            "serve", "--upstream", f"{model}/v1", "--port", str(gateway_port),
            ready_url=f"{root}/health", env={"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN},
        ),
    ):  # fmt: skip
        admin = ADMIN_HEADERS
        assert httpx.post(f"{root}/v1/rollouts/c1/register", json={"model": "m"}).status_code == 401
        r = httpx.post(f"{root}/v1/rollouts/c1/register", json={"model": "m"}, headers=admin)
        assert r.status_code == 200
        key = {"Authorization": f"Bearer {r.json()['api_key']}"}
        body = {"messages": [{"role": "user", "content": script({"say": "from the cli"})}]}
        r = httpx.post(f"{root}/v1/rollouts/c1/chat/completions", json=body, headers=key)
        assert r.json()["choices"][0]["message"]["content"] == "from the cli"
        traj = httpx.get(f"{root}/v1/rollouts/c1/trajectory", headers=admin).json()
        assert traj["num_turns"] == 1


def test_server_and_scripted_model_do_not_import_verifiers() -> None:
    code = (
        "import sys, rollout_gateway.server, rollout_gateway.scripted, rollout_gateway.cli; "
        "sys.exit(1 if 'verifiers' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
