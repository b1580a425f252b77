"""The regression guard on the gateway's instructions per turn (``.ci/run speed-guard``).

Runs :mod:`instructions` for the memory gateway, chat, at 1k and 32k contexts (4 vs 8
turns, 4 rollouts), and compares each figure with the recorded baseline
(``benchmarks/instructions_baseline.json``): it fails (exit 1) when one rose by more
than ``--tolerance`` (5%), and prints both figures either way. A count is the same on
any machine however loaded (valgrind), but not across interpreters or library
versions: the baseline names those it was recorded with, and a run on others says so.

Changing the baseline is a deliberate commit with its reason::

    python benchmarks/instructions_guard.py                       # check
    python benchmarks/instructions_guard.py --record "why"        # write a new baseline
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import instructions

BASELINE = Path(__file__).with_name("instructions_baseline.json")
CELLS = [instructions.Cell(1000, "chat"), instructions.Cell(32000, "chat")]
#: What a count depends on beyond the code: recorded with the baseline.
PACKAGES = ("orjson", "uvloop", "httptools", "uvicorn", "starlette", "xxhash")


def environment() -> dict[str, str]:
    """The interpreter and the versions of the packages a count depends on."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def measure(rollouts: int) -> dict[str, float]:
    """The memory gateway's marginal instructions per turn in each guarded cell."""
    args = instructions._parser().parse_args(
        ["--setups", "memory", "--modes", "chat", "--contexts", "1000,32000",
         "--rollouts", str(rollouts)]
    )  # fmt: skip
    instructions._defaults(instructions._parser(), args)
    instructions._precompile(args.tools, None)
    port = instructions._free_port()
    root = f"http://127.0.0.1:{port}"
    model = [sys.executable, instructions.__file__, "--serve-model", str(port)]
    with instructions._process(model, f"{root}/v1/models"), tempfile.TemporaryDirectory() as tmp:
        plans = instructions.conversations(root, CELLS, args.turns, args.tool_output_chars)
        figures, _ = instructions.measure(args, Path(tmp), root, plans)
    return {cell.label: instructions.gateways(figures, "memory", cell) for cell in CELLS}


def check(baseline: dict[str, Any], now: dict[str, float], tolerance: float) -> bool:
    """Print each figure beside the baseline's; whether none rose beyond ``tolerance``."""
    ok = True
    print(f"gateway (memory) instructions per turn, M; fails above +{tolerance * 100:.0f}%:")
    for label, value in now.items():
        base = baseline["figures"][label]
        rise = value / base - 1
        failed = rise > tolerance
        ok = ok and not failed
        verdict = "FAIL" if failed else "ok"
        print(f"  {label:<10} now {value / 1e6:.3f}  baseline {base / 1e6:.3f}  "
              f"{rise * 100:+.1f}%  {verdict}")  # fmt: skip
    if baseline.get("environment") != environment():
        print(f"  note: recorded with {baseline.get('environment')}, run with {environment()}")
    return ok


def main() -> None:
    """Check the figures against the baseline (exit 1 on a rise), or record a new one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest rise (0.05)")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per cell (4)")
    parser.add_argument("--record", metavar="REASON", help="write a new baseline, with why")
    args = parser.parse_args()
    now = measure(args.rollouts)
    if args.record:
        recorded = {"reason": args.record, "environment": environment(), "figures": now}
        args.baseline.write_text(json.dumps(recorded, indent=1) + "\n")
        shown = ", ".join(f"{label} {value / 1e6:.3f} M" for label, value in now.items())
        print(f"recorded {args.baseline}: {shown}")
        return
    baseline = json.loads(args.baseline.read_text())
    if not check(baseline, now, args.tolerance):
        sys.exit(1)


if __name__ == "__main__":
    main()
