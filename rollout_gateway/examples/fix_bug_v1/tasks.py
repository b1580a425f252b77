"""The fix-the-bug tasks (v1): the classic example's tasks, as a v1 taskset.

Each task is one of :data:`rollout_gateway.examples.fix_bug_env.tasks.TASKS` (a tiny
repository with one bug and a plain-Python test), in the same order and with the same
prompt, whose ``<script>`` block is the policy of the built-in scripted model. The
reward runs the test in the rollout's runtime after the agent exited: 1.0 when it passes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.runtimes import Runtime

from rollout_gateway.examples.fix_bug_env import tasks as shared

#: The taskset id verifiers v1 resolves (module :mod:`rollout_gateway_fix_bug_v1`).
TASKSET_ID = "rollout-gateway-fix-bug-v1"


class FixBugData(vf.TaskData):
    """A repository (path -> content) and the command that tests it."""

    files: dict[str, str]
    test_command: str


def task_prompt(description: str, steps: list[Any]) -> str:
    """A prompt for a task of your own: the task, then the scripted model's policy
    (``steps``, one per assistant turn; a real model ignores the block)."""
    return (
        f"{description}\nRun the test with the run_shell tool to check your fix.\n\n"
        "(For the scripted demo model only; ignore it otherwise:)\n"
        f"<script>{json.dumps(steps)}</script>"
    )


class FixBugTask(vf.Task[FixBugData]):
    """Write the repository into the runtime; reward = the test passes."""

    async def setup(self, trace: vf.Trace, runtime: Runtime) -> None:
        for path, content in self.data.files.items():
            await runtime.write(path, content.encode())

    @vf.reward
    async def tests_pass(self, runtime: Runtime) -> float:
        """1.0 when the repository's test passes in the rollout's runtime."""
        result = await runtime.run(["/bin/sh", "-c", self.data.test_command], {})
        return 1.0 if result.exit_code == 0 else 0.0


class FixBugTaskset(vf.Taskset[FixBugTask]):
    """The fix-the-bug tasks, in the classic example's order."""

    def load(self) -> Iterable[FixBugTask]:
        for task in shared.TASKS:
            data = FixBugData(
                id=task.task_id,
                name=task.task_id,
                prompt=shared.task_prompt(task),
                files=dict(task.files),
                test_command=task.test_command,
            )
            yield FixBugTask(data, self.config.task)


__all__ = ["TASKSET_ID", "FixBugData", "FixBugTask", "FixBugTaskset", "task_prompt"]
