"""``vf-eval rollout-gateway-fix-bug-v1``: the v1 fix-the-bug example, by its taskset id.

verifiers v1 loads a taskset (and its harness and env) from a top-level module that
exports one ``Taskset``, ``Harness`` and ``Env`` subclass each (a dotted id would not
load), so this module re-exports :mod:`rollout_gateway.examples.fix_bug_v1`. Needs
``rollout-gateway[v1]``.
"""

from rollout_gateway.examples.fix_bug_v1 import (
    FixBugEnv,
    FixBugHarness,
    FixBugHarnessConfig,
    FixBugTask,
    FixBugTaskset,
)

__all__ = ["FixBugEnv", "FixBugHarness", "FixBugHarnessConfig", "FixBugTask", "FixBugTaskset"]
