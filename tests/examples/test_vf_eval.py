"""The ``vf-eval`` commands of docs/demo.md run the example env: gateway mode on the local
backend (reference gateway + scripted model on loopback), and interception mode on the local
backend (no gateway, no tunnel)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.runner import server_thread

VF_EVAL = Path(sys.executable).parent / "vf-eval"


def vf_eval(
    base_url: str, env_args: dict[str, object], out: Path, admin_token: str | None = None
) -> list[dict]:
    """Run the docs' command; return the saved rollouts."""
    if not VF_EVAL.exists() and shutil.which("vf-eval") is None:
        pytest.skip("vf-eval is not installed next to this interpreter")
    command = [
        str(VF_EVAL if VF_EVAL.exists() else shutil.which("vf-eval")),
        "rollout_gateway.examples.fix_bug_env",
        "-m",
        "scripted",
        "-b",
        base_url,
        "-k",
        "OPENAI_API_KEY",
        "-n",
        "1",
        "-r",
        "1",
        "-T",
        "0",
        "-a",
        json.dumps(env_args),
        "-d",  # plain logs instead of the full-screen display
        "--disable-env-server",  # the env runs in the vf-eval process: faster to start
        "-s",
        "-o",
        str(out),
    ]
    env = {**os.environ, "OPENAI_API_KEY": "unused"}
    if admin_token is not None:  # how an operator hands the gateway's token to the env
        env["ROLLOUT_GATEWAY_ADMIN_TOKEN"] = admin_token
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=240, cwd=out.parent
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = list(out.glob("evals/*/*/results.jsonl"))
    assert len(results) == 1, done.stdout[-2000:]
    return [json.loads(line) for line in results[0].read_text().splitlines()]


def test_vf_eval_runs_the_example_in_gateway_mode_on_local_sandboxes(tmp_path: Path) -> None:
    with server_thread(create_scripted_model_app()) as model_root:
        token = "vf-eval-admin-token"
        gateway = create_app(GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=token))
        with server_thread(gateway) as gateway_root:
            rows = vf_eval(
                f"{gateway_root}/v1",
                {"sandbox_backend": "local", "local_sandbox_root": str(tmp_path / "sb")},
                tmp_path / "out",
                admin_token=token,
            )
    assert len(rows) == 1
    assert rows[0]["reward"] == 1.0 and rows[0]["error"] is None
    assert not list((tmp_path / "sb").iterdir())


def test_vf_eval_runs_the_example_in_interception_mode_on_local_sandboxes(
    tmp_path: Path,
) -> None:
    with server_thread(create_scripted_model_app()) as model_root:
        rows = vf_eval(
            f"{model_root}/v1",
            {
                "use_gateway": False,
                "sandbox_backend": "local",
                "local_sandbox_root": str(tmp_path / "sb"),
            },
            tmp_path / "out",
        )
    assert len(rows) == 1
    assert rows[0]["reward"] == 1.0 and rows[0]["error"] is None
