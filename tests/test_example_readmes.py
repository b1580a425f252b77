"""The commands of ``examples/*/README.md`` work as written: each ``bash`` block of the
installed stack's example runs in a fresh directory, in order, with two changes only:
``pip install`` lines are left out (this environment is that install, and the test
machine has no package index), and the ports 8000/8001 become free ones (other tests
and processes share this machine)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from stacks import STACK
from support.local_cluster import free_port

from rollout_gateway import child_processes

REPO = Path(__file__).resolve().parents[1]
README = {
    "classic": REPO / "examples" / "fix_bug_env" / "README.md",
    "v1": REPO / "examples" / "fix_bug_v1" / "README.md",
}

pytestmark = pytest.mark.skipif(STACK not in README, reason="needs a verifiers stack")


def bash_blocks(readme: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.DOTALL)


def as_run_here(block: str) -> str:
    """The block without its ``pip install`` lines, on free ports."""
    lines = [line for line in block.splitlines() if not line.startswith("pip install")]
    script = "\n".join(lines)
    ports = {p: str(free_port()) for p in ("8000", "8001")}
    for old, new in ports.items():
        script = re.sub(rf"(:|--port ){old}\b", lambda m, new=new: m.group(1) + new, script)
    return script


def run_block(script: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env["ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT"] = str(cwd / "sandboxes")
    env.pop("ROLLOUT_GATEWAY_ADMIN_TOKEN", None)
    # Its own process group: its background servers are ours to stop, and die with this
    # process even if it is killed with kill -9 (the whole group, not only the shell).
    proc = child_processes.spawn(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        whole_group=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def test_the_readme_of_the_installed_stacks_example_runs_as_written(tmp_path: Path) -> None:
    readme = README[STACK]
    vf_eval_block, demo_block = bash_blocks(readme)
    assert "pip install -e" in vf_eval_block and "kill %1 %2" in vf_eval_block

    done = run_block(as_run_here(vf_eval_block), tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    if STACK == "v1":
        (traces,) = (tmp_path / "outputs").glob("*/traces.jsonl")
        episodes = [json.loads(line) for line in traces.read_text().splitlines()]
        assert len(episodes) == 2 and all(e["ok"] for e in episodes)
        assert (traces.parent / "configs" / "resolved" / "eval.json").is_file()
    else:
        (results,) = (tmp_path / "outputs").glob("evals/*/*/results.jsonl")
        rows = [json.loads(line) for line in results.read_text().splitlines()]
        assert len(rows) == 2 and all(r["error"] is None for r in rows)

    here = tmp_path / "demo"
    here.mkdir()
    done = run_block(demo_block, here)
    assert done.returncode in (0, 1), done.stdout[-4000:]  # 1: a wrong fix at temperature 0.7
    assert "status         completed" in done.stdout
    (run,) = (here / "outputs").iterdir()
    assert json.loads((run / "metadata.json").read_text())["stack"] == STACK
