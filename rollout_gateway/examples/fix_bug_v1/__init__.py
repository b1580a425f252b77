"""fix_bug_v1: the fix-the-bug example as a verifiers v1 taskset, harness and env.

The same tasks as :mod:`rollout_gateway.examples.fix_bug_env` (the classic example) and
the same agent program (its ``agent.py``), for verifiers 0.4 (``rollout-gateway[v1]``):

- :class:`FixBugTaskset` / :class:`FixBugTask`: a tiny repository with one bug per task;
  the reward runs the repository's test in the rollout's runtime.
- :class:`FixBugHarness`: runs ``agent.py`` with the env's own interpreter (no container,
  no package index needed).
- :class:`FixBugEnv`: the single-agent env with the ``gateway`` interception type.

Shipped inside rollout-gateway, so an installed wheel runs ``rollout-gateway demo`` on
v1. verifiers v1 loads a taskset by the id of a top-level module, so the id is
``rollout-gateway-fix-bug-v1`` (module :mod:`rollout_gateway_fix_bug_v1`, which
re-exports these names).
"""

from rollout_gateway.examples.fix_bug_v1.env import FixBugEnv
from rollout_gateway.examples.fix_bug_v1.harness import FixBugHarness, FixBugHarnessConfig
from rollout_gateway.examples.fix_bug_v1.tasks import (
    TASKSET_ID,
    FixBugData,
    FixBugTask,
    FixBugTaskset,
    task_prompt,
)

__all__ = [
    "TASKSET_ID",
    "FixBugData",
    "FixBugEnv",
    "FixBugHarness",
    "FixBugHarnessConfig",
    "FixBugTask",
    "FixBugTaskset",
    "task_prompt",
]
