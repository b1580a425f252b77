"""The demo on verifiers 0.3: its run directory is what vf-eval 0.3.1 writes for the same
run (``results.jsonl``, ``metadata.json`` with vf-eval's keys and more), and each result
carries the agent's tools and the model's time as verifiers' own loop records them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_gateway.cli import main
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.runner import server_thread

VF_EVAL = Path(sys.executable).with_name("vf-eval")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo run: 1 task x 1 rollout at temperature 0."""
    base = tmp_path_factory.mktemp("demo")
    out = base / "run"
    old = os.environ.get("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT")
    os.environ["ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT"] = str(base / "sandboxes")
    try:
        args = ["--examples", "1", "--rollouts-per-example", "1", "--temperature", "0"]
        assert main(["demo", *args, "--output", str(out)]) == 0
    finally:
        if old is None:
            os.environ.pop("ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT")
        else:
            os.environ["ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT"] = old
    return out


def vf_eval_metadata(tmp_path: Path) -> dict[str, Any]:
    """vf-eval 0.3.1's ``metadata.json`` for the same run (same env, model, sampling)."""
    import subprocess

    token = "vf-eval-admin-token-0123456789"
    with server_thread(create_scripted_model_app()) as model_root:
        gateway = create_app(GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=token))
        with server_thread(gateway) as gateway_root:
            env_args = {"sandbox_backend": "local", "local_sandbox_root": str(tmp_path / "sb")}
            command = [str(VF_EVAL), "rollout_gateway.examples.fix_bug_env", "-m", "scripted"]
            command += ["-b", f"{gateway_root}/v1", "-k", "OPENAI_API_KEY", "-n", "1", "-r", "1"]
            command += ["-T", "0", "-t", "512", "-a", json.dumps(env_args), "-d"]
            command += ["--disable-env-server", "-s", "-o", str(tmp_path / "out")]
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
                env={**os.environ, "OPENAI_API_KEY": "x", "ROLLOUT_GATEWAY_ADMIN_TOKEN": token},
            )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("evals/*/*/metadata.json")
    return dict(json.loads(path.read_text()))


def test_metadata_has_every_key_vf_eval_writes_for_the_same_run(
    demo_run: Path, tmp_path: Path
) -> None:
    ours = json.loads((demo_run / "metadata.json").read_text())
    theirs = vf_eval_metadata(tmp_path)
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    for key in ("env_id", "model", "num_examples", "rollouts_per_example", "avg_reward"):
        assert ours[key] == theirs[key], key
    assert ours["sampling_args"] == {"temperature": 0.0, "max_tokens": 512}
    assert ours["sampling_args"].items() <= {**theirs["sampling_args"]}.items()
    assert set(theirs["version_info"]) <= set(ours["version_info"])
    assert ours["base_url"].startswith("http://127.0.0.1:") and ours["base_url"].endswith("/v1")
    # The demo's own keys too.
    assert ours["status"] == "completed" and ours["stack"] == "classic"
    assert ours["tools"] and ours["tools"][0]["name"] == "run_shell"


def test_each_result_has_the_agents_tools_and_the_models_time(demo_run: Path) -> None:
    (row,) = [json.loads(line) for line in (demo_run / "results.jsonl").read_text().splitlines()]
    assert [tool["name"] for tool in row["tool_defs"]] == ["run_shell"]
    assert row["tool_defs"][0]["parameters"]["required"] == ["command"]
    spans = row["timing"]["model"]["spans"]
    assert len(spans) == len(row["trajectory"]) == 4
    assert all(0 < s["end"] - s["start"] < 60 for s in spans)
    assert row["timing"]["model"]["duration"] > 0
    assert row["timing"]["generation"]["start"] <= spans[0]["start"]
    assert row["rollout_index"] == 0 and row["sandbox_isolation"] in ("bwrap", "unshare", "uid")
