"""``rollout-gateway demo``: the whole system on one machine, run like an evaluation tool,
on either verifiers stack (the installed one).

- :mod:`.options`: what a run does (``DemoOptions``, the command-line arguments, checks).
- :mod:`.runner`: the run itself, the same on both stacks (preflight, run directory,
  setup, rollouts, signals, ``--timeout``, report, exit codes).
- :mod:`.stack`: what differs between stacks, the interface alone
  (:class:`~.stack.DemoStack`); each adapter lives beside its stack,
  :mod:`rollout_gateway.classic.demo` (verifiers 0.3) and :mod:`rollout_gateway.v1.demo`
  (verifiers 0.4), and :mod:`.adapters` resolves them by name.
- :mod:`.threads`: blocking work (imports, probes) off the event loop.
- :mod:`.help`: ``demo --help``, for the installed stack.
- :mod:`.resume`: the settings ``--resume`` reuses and the ones it refuses.
- :mod:`.run_dir`: the run directory and its ``metadata.json``.
- :mod:`.progress`: the live progress bar / plain lines and the summary table.
- :mod:`.preflight`: checks made before anything is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

from rollout_gateway.demo.options import (
    DemoError,
    DemoOptions,
    add_demo_arguments,
    options_from_args,
)

if TYPE_CHECKING:
    from rollout_gateway.demo.stack import DemoStack


def run_demo(
    options: DemoOptions,
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    stack: DemoStack | None = None,
) -> int:
    """Run the demo; returns the process exit code (see :mod:`.runner`)."""
    from rollout_gateway.demo.runner import run_demo as _run_demo

    return _run_demo(options, out, err, stack=stack)


__all__ = ["DemoError", "DemoOptions", "add_demo_arguments", "options_from_args", "run_demo"]
