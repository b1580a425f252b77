"""``bash .ci/run``: the README's test command and its parts (CONTRIBUTING.md), and the
real-vLLM recipe it uses from the repository (``tools/real-vllm``), nothing beside it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stacks import STACK

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tools" / "real-vllm"


def ci_run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / ".ci" / "run"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_step_and_a_bad_step_is_one_line() -> None:
    shown = ci_run("--help")
    assert shown.returncode == 0
    for step in (
        "lint",
        "classic",
        "v1",
        "real-engine",
        "speed-guard",
        "all",
        "--reuse",
        "--dry-run",
    ):
        assert step in shown.stdout
    bad = ci_run("tests")
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        ".ci/run: error: no step 'tests': all, lint, classic, v1, real-engine or speed-guard "
        "(see bash .ci/run --help)"
    ]


def test_the_whole_run_uses_the_recipe_in_the_repository() -> None:
    plan = ci_run("--dry-run", env={"ROLLOUT_GATEWAY_REAL_VLLM_URL": ""})
    assert plan.returncode == 0, plan.stderr
    steps = [line[2:] for line in plan.stderr.splitlines() if line.startswith("+ ")]
    order = [
        "ruff check .",
        "mkdocs build --strict",
        "-m pytest -q",
        ".ci-venv-v1/bin/mypy -p rollout_gateway.v1",
        "bash tools/real-vllm/setup.sh",
        "bash tools/real-vllm/serve.sh",
        "-m pytest -q -rs tests/real_engine",
        "benchmarks/instructions_guard.py",
    ]
    found = [next(i for i, step in enumerate(steps) if piece in step) for piece in order]
    assert found == sorted(found), steps
    assert "shared" not in (ROOT / ".ci" / "run").read_text()  # nothing beside the clone


def test_one_module_on_one_stack_really_runs() -> None:
    """What CONTRIBUTING.md shows: one module, this test run's stack, its venv kept."""
    if STACK not in ("classic", "v1"):
        pytest.skip("needs a verifiers stack")
    venv = {"classic": "CI_VENV", "v1": "CI_V1_VENV"}[STACK]
    ran = ci_run(
        "--reuse", STACK, "tests/test_exits.py", "-p", "no:cacheprovider",
        env={venv: sys.prefix}, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"(reusing {sys.prefix})" in ran.stderr
    assert " passed" in ran.stdout and "tests/test_exits.py" in ran.stderr


def test_a_set_up_vllm_is_not_built_again(tmp_path: Path) -> None:
    """setup.sh's stamps: a DEST set up by this recipe (the model step stamped with the
    hash of convert_model.py and the template) returns at once, building nothing."""
    dest = tmp_path / "dest"
    (dest / "venv" / "bin").mkdir(parents=True)
    (dest / "venv" / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (dest / "venv" / "bin" / "python").chmod(0o755)
    (dest / "model").mkdir()
    (dest / "model" / "config.json").write_text("{}")
    stamps = dest / ".stamps"
    stamps.mkdir()
    recipe = (RECIPE / "convert_model.py").read_bytes()
    recipe += (RECIPE / "gemma3_chat_template.jinja").read_bytes()
    for step in ("1-venv", "2-torch", "3-vllm", "5-verified"):
        (stamps / step).write_text("done\n")
    (stamps / "4-model").write_text(hashlib.sha256(recipe).hexdigest()[:16] + "\n")
    done = subprocess.run(
        ["bash", str(RECIPE / "setup.sh"), str(dest)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert "already set up" in done.stdout


def test_serving_a_dest_that_is_not_set_up_says_how_to_set_it_up(tmp_path: Path) -> None:
    served = subprocess.run(
        ["bash", str(RECIPE / "serve.sh"), str(tmp_path), "8001"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert served.returncode == 1
    assert f"run: bash tools/real-vllm/setup.sh {tmp_path}" in served.stderr
    assert served.stdout == ""  # no PID: nothing started
