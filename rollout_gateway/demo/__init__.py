"""``rollout-gateway demo``: the whole system on one machine, run like an evaluation tool.

- :mod:`.options`: what a run does (``DemoOptions``, the command-line arguments).
- :mod:`.runner`: the run itself (servers, env, rollouts, signals, ``--resume``).
- :mod:`.results`: ``results.jsonl`` and ``metadata.json``.
- :mod:`.progress`: the live progress bar / plain lines and the summary table.
- :mod:`.preflight`: checks made before any sandbox starts.
"""

from __future__ import annotations

from typing import TextIO

from rollout_gateway.demo.options import (
    DemoError,
    DemoOptions,
    add_demo_arguments,
    options_from_args,
)


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Run the demo; returns the process exit code (see :mod:`.runner`)."""
    from rollout_gateway.demo.runner import run_demo as _run_demo

    return _run_demo(options, out)


__all__ = ["DemoError", "DemoOptions", "add_demo_arguments", "options_from_args", "run_demo"]
