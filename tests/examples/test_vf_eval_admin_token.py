"""vf-eval with an env that lacks the gateway's admin token: one configuration error that
names the setting, a failed run, no retries, no sandbox (issue 25)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.runner import server_thread

VF_EVAL = Path(sys.executable).parent / "vf-eval"
TOKEN = "vf-eval-admin-token-0123"


def test_vf_eval_without_the_admin_token_fails_once_naming_the_setting(tmp_path: Path) -> None:
    if not VF_EVAL.exists() and shutil.which("vf-eval") is None:
        pytest.skip("vf-eval is not installed next to this interpreter")
    sandboxes = tmp_path / "sb"
    env_args = {"sandbox_backend": "local", "local_sandbox_root": str(sandboxes)}
    with server_thread(create_scripted_model_app()) as model_root:
        gateway = create_app(GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=TOKEN))
        with server_thread(gateway) as gateway_root:
            command = [
                str(VF_EVAL if VF_EVAL.exists() else shutil.which("vf-eval")),
                "rollout_gateway.examples.fix_bug_env",
                "-m", "scripted", "-b", f"{gateway_root}/v1", "-k", "OPENAI_API_KEY",
                "-n", "2", "-r", "2", "-d", "--disable-env-server",
                "-a", json.dumps(env_args),
                "-o", str(tmp_path / "out"),
            ]  # fmt: skip
            env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_GATEWAY_ADMIN")}
            env["OPENAI_API_KEY"] = "unused"
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path
            )
            metrics = httpx.get(
                f"{gateway_root}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
            ).text
    output = done.stdout + done.stderr
    print(output[-3000:])
    assert done.returncode != 0  # the run failed; it did not pass with errored rollouts
    assert "GatewayAuthError" in output
    assert "the env sent no admin token" in output
    assert "$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE" in output
    assert "Retrying" not in output  # never retried as an infrastructure error
    refused = re.search(r'rollout_gateway_rejected_requests_total\{status="401"\} (\d+)', metrics)
    assert refused is not None and int(refused.group(1)) == 1, metrics  # 4 rollouts, 1 call
    assert not sandboxes.exists() or not list(sandboxes.iterdir())  # no sandbox left
