"""``pip install 'rollout-gateway[v1]'`` (or ``[classic]``) then ``rollout-gateway demo``:
the built wheel alone runs the demo of the installed stack from an empty directory (both
examples ship inside the package). Runs in each stack's test environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from stacks import STACK

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(STACK == "none", reason="needs a verifiers stack")
def test_installed_wheel_runs_the_demo(tmp_path: Path) -> None:
    # Built from a clean copy: a stale build/ in the checkout would leak old modules in.
    source = tmp_path / "source"
    junk = ("build", "dist", ".git", ".venv*", ".ci-venv", "*.egg-info", "__pycache__", "outputs")
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*junk, ".*_cache"))
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = dist.glob("rollout_gateway-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rollout_gateway/examples/fix_bug_env/agent.py" in names
    assert "rollout_gateway/examples/fix_bug_v1/tasks.py" in names
    assert "rollout_gateway_fix_bug_v1/__init__.py" in names  # the v1 taskset id's module
    assert "rollout_gateway/py.typed" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + ["--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    # Dependencies come from this test environment's site-packages, added as a plain path
    # (its .pth files, including the editable install of this checkout, are not processed).
    purelib = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (purelib / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT"] = str(tmp_path / "sandboxes")
    example = "fix_bug_env" if STACK == "classic" else "fix_bug_v1"
    where = subprocess.run(
        [str(python), "-c", f"import rollout_gateway.examples.{example} as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # not the checkout

    empty = tmp_path / "empty"
    empty.mkdir()
    demo = subprocess.run(
        [str(venv / "bin" / "rollout-gateway"), "demo", "--examples", "1"]
        + ["--rollouts-per-example", "1", "--temperature", "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=empty,
        timeout=240,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    (out,) = (empty / "outputs").iterdir()  # the default: outputs/demo-<date>-<time>
    assert out.name.startswith("demo-")
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["status"] == "completed" and meta["stack"] == STACK
    assert meta["counts"]["done"] == 1 and meta["counts"]["mean_reward"] == 1.0
    if STACK == "classic":
        (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        assert row["reward"] == 1.0 and row["error"] is None
    else:
        (row,) = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
        assert row["ok"] and row["traces"][0]["rewards"]["tests_pass"]["score"] == 1.0
