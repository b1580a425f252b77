"""``vf-eval fix-bug-v1``: the v1 fix-the-bug example as its own installable env package.

The taskset, harness and env ship inside rollout-gateway
(:mod:`rollout_gateway.examples.fix_bug_v1`, id ``rollout-gateway-fix-bug-v1``); this
package gives them the id ``fix-bug-v1`` and is the shape of an env package a v1 env
author writes: a top-level module exporting one ``Taskset``, ``Harness`` and ``Env``.
"""

from rollout_gateway.examples.fix_bug_v1 import (
    FixBugEnv,
    FixBugHarness,
    FixBugHarnessConfig,
    FixBugTask,
    FixBugTaskset,
)

__all__ = ["FixBugEnv", "FixBugHarness", "FixBugHarnessConfig", "FixBugTask", "FixBugTaskset"]
