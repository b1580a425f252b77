"""The fix-the-bug tasks (v1): tiny repositories with one bug and a plain-Python test.

Each prompt ends with a ``<script>`` block, the policy of the built-in scripted model
(``rollout_gateway.scripted``): one step per assistant turn. The reward runs the test in
the rollout's runtime after the agent exited: 1.0 when it passes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.runtimes import Runtime


def _shell(command: str) -> dict[str, Any]:
    return {"tool": "run_shell", "arguments": {"command": command}}


def _replace(path: str, old: str, new: str) -> str:
    return (
        "python3 -c 'import pathlib; "
        f'p = pathlib.Path("{path}"); '
        f'p.write_text(p.read_text().replace("{old}", "{new}"))'
        "'"
    )


class FixBugData(vf.TaskData):
    """A repository (path -> content) and the command that tests it."""

    files: dict[str, str]
    test_command: str


_ROWS: list[dict[str, Any]] = [
    {
        "id": "calc-add",
        "description": "`add` in calc.py returns the wrong result. Fix it.",
        "files": {
            "calc.py": "def add(a, b):\n    return a - b\n",
            "test_calc.py": "from calc import add\n\nassert add(2, 3) == 5\nprint('ok')\n",
        },
        "test": "python3 test_calc.py",
        "steps": [
            _shell("cat calc.py"),
            _shell(_replace("calc.py", "a - b", "a + b")),
            _shell("python3 test_calc.py"),
            {"say": "Fixed add: it now returns a + b."},
        ],
    },
    {
        "id": "clamp-bounds",
        "description": "`clamp` in clamp.py ignores the upper bound. Fix it.",
        "files": {
            "clamp.py": "def clamp(x, lo, hi):\n    return max(lo, x)\n",
            "test_clamp.py": (
                "from clamp import clamp\n\nassert clamp(5, 0, 3) == 3\n"
                "assert clamp(-1, 0, 3) == 0\nprint('ok')\n"
            ),
        },
        "test": "python3 test_clamp.py",
        "steps": [
            _shell("cat clamp.py"),
            _shell(_replace("clamp.py", "max(lo, x)", "min(hi, max(lo, x))")),
            _shell("python3 test_clamp.py"),
            {"say": "Fixed clamp: the upper bound now applies."},
        ],
    },
]


def task_prompt(description: str, steps: list[Any]) -> str:
    """The prompt: the task, then the scripted model's policy (a real model ignores it)."""
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
    """The fix-the-bug tasks."""

    def load(self) -> Iterable[FixBugTask]:
        for row in _ROWS:
            data = FixBugData(
                id=row["id"],
                name=row["id"],
                prompt=task_prompt(row["description"], row["steps"]),
                files=row["files"],
                test_command=row["test"],
            )
            yield FixBugTask(data, self.config.task)
