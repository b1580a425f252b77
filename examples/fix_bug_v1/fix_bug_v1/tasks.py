"""The tasks' data and prompt (re-exported from :mod:`rollout_gateway.examples.fix_bug_v1`)."""

from rollout_gateway.examples.fix_bug_v1.tasks import FixBugData, FixBugTask, task_prompt

__all__ = ["FixBugData", "FixBugTask", "task_prompt"]
