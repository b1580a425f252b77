"""The benchmark commands the docs show run and take the options the docs show with them
(``--help`` only: figures are measured by running the benchmarks, never in tests).

The options are read from the docs, so a page cannot name an option a benchmark lost:
those in the same code span as ``benchmarks/NAME.py`` anywhere, and, on the performance
page, every option in a paragraph that names one benchmark only (except in spans showing
another program's command line, such as ``vllm serve ...``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from stacks import STACK

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
#: Modules under benchmarks/ that other benchmarks import (no command line of their own).
HELPERS = {"burst_world.py", "process_sandbox.py"}
#: Benchmarks that import verifiers 0.4 at start (the docs say so for each).
V1_ONLY = {"tito_branches.py", "v1_interception_cpu.py"}

_SPAN = re.compile(r"`([^`]+)`")
_SCRIPT = re.compile(r"benchmarks/(\w+\.py)")
#: A span showing another program's command line (its options are not the benchmark's).
_OTHER_COMMAND = re.compile(r"\b(vllm|rollout-gateway|serve)\b")
#: An option, not a value of another (``--gateway-option=--loop=asyncio`` shows one).
_OPTION = re.compile(r"(?<![=\w-])--[a-z][a-z0-9-]*")


def documented_options() -> dict[str, set[str]]:
    """Each benchmark the docs name -> the options they show with it."""
    found: dict[str, set[str]] = {}
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        for paragraph in re.split(r"\n\s*\n|\n(?=- )", text):
            spans = _SPAN.findall(paragraph)
            named = {m for span in spans for m in _SCRIPT.findall(span)} - HELPERS
            for script in named:
                found.setdefault(script, set())
            for span in spans:
                for script in set(_SCRIPT.findall(span)) - HELPERS:
                    found[script] |= set(_OPTION.findall(span))
            if page.name == "performance.md" and len(named) == 1:
                (script,) = named
                own = [span for span in spans if not _OTHER_COMMAND.search(span)]
                found[script] |= {o for span in own for o in _OPTION.findall(span)}
    return found


DOCUMENTED = documented_options()


def test_the_docs_show_every_benchmark_with_its_options() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - HELPERS
    assert set(DOCUMENTED) == scripts
    assert DOCUMENTED["gateway_overhead.py"] >= {"--compare-source", "--stack-floor"}


@pytest.mark.parametrize("script", sorted(DOCUMENTED))
def test_benchmark_answers_help_with_the_documented_options(script: str) -> None:
    if script in V1_ONLY and STACK != "v1":
        pytest.skip(f"{script} needs verifiers 0.4 (the v1 stack)")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    missing = [option for option in DOCUMENTED[script] if option not in done.stdout]
    assert not missing, f"{script} --help lacks {missing}"
