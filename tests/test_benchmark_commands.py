"""The benchmark commands the README shows run and take the options it shows (``--help``
only: figures are measured by running the benchmarks, never in tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from stacks import STACK

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: Each benchmark the README names -> the options it shows for it.
README_OPTIONS = {
    "burst.py": ["--rollouts", "--hosts"],
    "burst_compare.py": [
        "--rollouts", "--rounds", "--earlier-venv", "--setup-earlier", "--workers", "--gc-freeze",
    ],
    "gateway_overhead.py": [
        "--turns", "--contexts", "--concurrency", "--compare-source", "--gateway-option",
        "--model-latency-ms", "--clients", "--lockstep", "--stack-floor",
    ],
    "local_sandbox_modes.py": ["--commands", "--sandboxes"],
    "tito_branches.py": ["--upstream"],
    "upstream_client.py": ["--calls", "--concurrency", "--rounds", "--stream"],
    "v1_interception_cpu.py": [
        "--quick", "--contexts", "--rollouts", "--concurrency", "--repeat", "--turns-short",
        "--turns-long",
    ],
}  # fmt: skip
#: Benchmarks that import verifiers 0.4 at start (the README says so for each).
V1_ONLY = {"tito_branches.py", "v1_interception_cpu.py"}


@pytest.mark.parametrize("script", sorted(README_OPTIONS))
def test_benchmark_answers_help_with_the_readme_options(script: str) -> None:
    if script in V1_ONLY and STACK != "v1":
        pytest.skip(f"{script} needs verifiers 0.4 (the v1 stack)")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    missing = [option for option in README_OPTIONS[script] if option not in done.stdout]
    assert not missing, f"{script} --help lacks {missing}"
