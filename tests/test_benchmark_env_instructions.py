"""``benchmarks/env_instructions.py``: its command line, and the counted pair it runs.

No figures are measured here (that is the benchmark's job): the command line refuses
what it cannot measure, and a pair of counted processes speaks the benchmark's protocol
(ready, go, done, stop) and is counted by cachegrind, the longer one more.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "env_instructions.py"
sys.path.insert(0, str(BENCHMARKS))

import env_instructions  # noqa: E402

needs_valgrind = pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")

#: A counted process as the benchmark drives one: READY, SIGUSR1, ``argv[1]`` units of
#: work, DONE, SIGUSR2, its result file written.
PROGRAM = f"""
import asyncio, json, signal, sys
async def main():
    loop = asyncio.get_running_loop()
    go, stop = asyncio.Event(), asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    loop.add_signal_handler(signal.SIGUSR2, stop.set)
    print({env_instructions.READY!r}, flush=True)
    await go.wait()
    total = sum(i * i for i in range(int(sys.argv[1]) * 200_000))
    open(sys.argv[3], "w").write(json.dumps([{{"total": total}}]))
    print({env_instructions.DONE!r}, flush=True)
    await stop.wait()
asyncio.run(main())
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_help_names_the_options_without_importing_verifiers() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for option in ("--quick", "--compare-source", "--rollouts", "--contexts", "--stack"):
        assert option in done.stdout
    assert "--run-env" not in done.stdout  # the counted env's own options stay hidden


@needs_valgrind
def test_compare_source_is_refused_on_the_v1_stack(tmp_path: Path) -> None:
    done = _run("--stack", "v1", "--compare-source", str(tmp_path))
    assert done.returncode == 2
    assert "--compare-source is for the classic stack" in done.stderr


@needs_valgrind
def test_a_pair_is_counted_and_the_longer_one_executes_more(tmp_path: Path) -> None:
    pair = [
        env_instructions.CountedEnv(
            f"p{units}", [sys.executable, "-c", PROGRAM, str(units)], tmp_path, {}
        )
        for units in (1, 3)
    ]
    short, long = env_instructions.run_pair(pair, timeout=300)
    assert [env.proc.returncode for env in pair] == [0, 0]
    assert all(env.outcomes()[0]["total"] > 0 for env in pair)
    # Each lived as long from ready to its stop, whatever its own work took.
    assert long - short > 1_000_000
    assert all(env.done >= env.ready > 0 for env in pair)
