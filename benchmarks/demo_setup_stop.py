"""How fast ``rollout-gateway demo`` stops on Ctrl-C during setup (target: 1 s).

Starts the demo of the installed verifiers stack, waits for its first line (the run
directory exists: setup begins, the stack being imported), sends SIGINT after
``--delay`` seconds, and measures the time from the signal to the process's exit. Prints
each run (and whether the signal landed in setup or after the rollouts began: a later
``--delay``) and the median and worst of those in setup; checks the exit code (130) and
that the run directory ended ``interrupted``.

    python benchmarks/demo_setup_stop.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollout_gateway import child_processes


def one(workdir: Path, delay: float) -> tuple[float, str]:
    out = workdir / "run"
    env = {**os.environ, "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT": str(workdir / "sandboxes")}
    # Dead with this benchmark, even by kill -9 (its own group: the SIGINT below is the
    # only one it gets).
    proc = child_processes.spawn(
        [sys.executable, "-m", "rollout_gateway.cli", "demo", "--output", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("results "):
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    rest, _ = proc.communicate(timeout=120)
    took = time.perf_counter() - sent
    if proc.returncode != 130:
        raise SystemExit(f"exit code {proc.returncode}, not 130:\n{rest}")
    meta = json.loads((out / "metadata.json").read_text())
    if meta["status"] != "interrupted":
        raise SystemExit(f"unexpected metadata after the stop: {meta}")
    phase = "setup" if "setup abandoned" in rest else "rollouts (sandboxes removed)"
    return took, phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs (default: %(default)s)")
    parser.add_argument(
        "--delay",
        type=float,
        default=0.2,
        help="seconds after setup begins before the signal (default: %(default)s)",
    )
    args = parser.parse_args()
    times = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="demo-stop-") as tmp:
            took, phase = one(Path(tmp), args.delay)
        if phase == "setup":
            times.append(took)
        print(f"run {i + 1}: stopped {took:.3f} s after SIGINT, during {phase}", flush=True)
    if times:
        print(
            f"SIGINT during setup -> exit: median {statistics.median(times):.3f} s, "
            f"worst {max(times):.3f} s over {len(times)} runs (target 1 s)"
        )


if __name__ == "__main__":
    main()
