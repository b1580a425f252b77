"""The fix-the-bug tasks: tiny repositories, each with one bug and a plain-Python test.

Every test runs with ``python3 test_<name>.py`` (no pytest in the sandbox) and exits
non-zero while the bug is there. Each prompt ends with a ``<script>`` block, the policy of
the built-in scripted demo model (``rollout_gateway.scripted``): a JSON list of steps, one
per assistant turn (``run_shell`` tool calls, a final ``say``, or ``one_of`` alternatives,
the first at temperature 0, a seeded random one otherwise). Tasks whose fix step is a
``one_of`` with wrong alternatives give varying rewards at temperature > 0. A real model
sees an ordinary task description followed by that block, which it is told to ignore.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["TASKS", "Task", "build_dataset", "replace_command", "task_prompt"]


@dataclass(frozen=True)
class Task:
    """One buggy repository."""

    task_id: str
    description: str
    files: dict[str, str]  # relative path -> content, buggy state
    buggy_file: str
    test_file: str
    fixed_source: str  # the buggy file once correctly fixed (the dataset's ``answer``)
    fix_step: dict[str, Any]  # the scripted model's fix: a run_shell step or a one_of

    @property
    def test_command(self) -> str:
        return f"python3 {self.test_file}"


def replace_command(path: str, old: str, new: str) -> str:
    """A portable shell command replacing ``old`` by ``new`` in ``path`` (no ``sed -i``,
    whose syntax differs between GNU and BSD)."""
    for text in (path, old, new):
        if "'" in text or '"' in text or "\\" in text:
            raise ValueError(f"keep quotes and backslashes out of scripted edits: {text!r}")
    return (
        "python3 -c 'import pathlib; "
        f'p = pathlib.Path("{path}"); '
        f'p.write_text(p.read_text().replace("{old}", "{new}"))'
        "'"
    )


def _shell(command: str) -> dict[str, Any]:
    return {"tool": "run_shell", "arguments": {"command": command}}


def _test_harness(module: str, source: str, checks: list[str]) -> str:
    names = ", ".join(re.findall(r"^def (\w+)", source, flags=re.MULTILINE))
    lines = [f"from {module} import {names}", "", "", "def main():"]
    lines += [f"    {check}" for check in checks]
    lines += ['    print("all tests passed")', "", ""]
    lines += ['if __name__ == "__main__":', "    main()", ""]
    return "\n".join(lines)


_CALC_BUGGY = '''def add(a, b):
    """Return the sum of a and b."""
    return a - b


def mul(a, b):
    """Return the product of a and b."""
    return a * b
'''

_TEXT_BUGGY = '''def is_palindrome(text):
    """True when text reads the same backwards, ignoring case and non-alphanumerics."""
    cleaned = [c for c in text if c.isalnum()]
    return cleaned == cleaned[::-1]
'''

_STATS_BUGGY = '''def mean(values):
    """The arithmetic mean of a non-empty list of numbers."""
    return sum(values) / (len(values) - 1)
'''

_FIZZ_BUGGY = '''def fizzbuzz(n):
    """The FizzBuzz sequence from 1 to n inclusive, as strings."""
    out = []
    for i in range(1, n):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out
'''

_CLAMP_BUGGY = '''def clamp(x, lo, hi):
    """x limited to the closed interval [lo, hi]."""
    return max(hi, min(lo, x))
'''


def _task(
    task_id: str,
    module: str,
    description: str,
    buggy: str,
    checks: list[str],
    fix: tuple[str, str],
    wrong_fixes: list[tuple[str, str]] | None = None,
    give_up: bool = False,
) -> Task:
    path = f"{module}.py"
    good = _shell(replace_command(path, *fix))
    if wrong_fixes or give_up:
        options = [good] + [_shell(replace_command(path, *w)) for w in wrong_fixes or []]
        if give_up:
            options.append(_shell(f"echo 'not sure what is wrong in {path}'"))
        fix_step: dict[str, Any] = {"one_of": options}
    else:
        fix_step = good
    return Task(
        task_id=task_id,
        description=description,
        files={path: buggy, f"test_{module}.py": _test_harness(module, buggy, checks)},
        buggy_file=path,
        test_file=f"test_{module}.py",
        fixed_source=buggy.replace(*fix),
        fix_step=fix_step,
    )


TASKS: list[Task] = [
    _task(
        "calc-add",
        "calc",
        "`add(2, 3)` returns -1 instead of 5.",
        _CALC_BUGGY,
        [
            'assert add(2, 3) == 5, f"add(2, 3) returned {add(2, 3)}"',
            "assert add(-1, 1) == 0",
            "assert mul(3, 4) == 12",
        ],
        fix=("return a - b", "return a + b"),
    ),
    _task(
        "text-palindrome",
        "text_utils",
        '`is_palindrome("Racecar")` returns False; case should not matter.',
        _TEXT_BUGGY,
        [
            'assert is_palindrome("Racecar"), "case must be ignored"',
            'assert is_palindrome("A man, a plan, a canal: Panama")',
            'assert not is_palindrome("hello")',
        ],
        fix=("[c for c in text", "[c.lower() for c in text"),
        wrong_fixes=[("cleaned = [c for c in text if c.isalnum()]", "cleaned = list(text)")],
    ),
    _task(
        "stats-mean",
        "stats",
        "`mean([1, 2, 3])` returns 3.0 instead of 2.0.",
        _STATS_BUGGY,
        [
            'assert mean([1, 2, 3]) == 2, f"mean([1, 2, 3]) returned {mean([1, 2, 3])}"',
            "assert mean([5]) == 5",
            "assert mean([-2, 2]) == 0",
        ],
        fix=("(len(values) - 1)", "len(values)"),
        wrong_fixes=[("(len(values) - 1)", "(len(values) + 1)")],
    ),
    _task(
        "fizzbuzz-range",
        "fizzbuzz",
        "`fizzbuzz(15)` has only 14 items and misses the final FizzBuzz.",
        _FIZZ_BUGGY,
        [
            'assert len(fizzbuzz(15)) == 15, f"got {len(fizzbuzz(15))} items"',
            'assert fizzbuzz(15)[-1] == "FizzBuzz"',
            'assert fizzbuzz(5) == ["1", "2", "Fizz", "4", "Buzz"]',
        ],
        fix=("range(1, n)", "range(1, n + 1)"),
        wrong_fixes=[("range(1, n)", "range(0, n)")],
        give_up=True,
    ),
    _task(
        "clamp-bounds",
        "clamp",
        "`clamp(5, 0, 10)` returns 10 instead of 5.",
        _CLAMP_BUGGY,
        [
            'assert clamp(5, 0, 10) == 5, f"clamp(5, 0, 10) returned {clamp(5, 0, 10)}"',
            "assert clamp(-3, 0, 10) == 0",
            "assert clamp(42, 0, 10) == 10",
        ],
        fix=("max(hi, min(lo, x))", "max(lo, min(hi, x))"),
        give_up=True,
    ),
]


def script_for(task: Task) -> list[dict[str, Any]]:
    """The scripted model's policy: look, fix, test, report."""
    return [
        _shell(f"cat {task.buggy_file}"),
        task.fix_step,
        _shell(task.test_command),
        {"say": f"Fixed the bug in {task.buggy_file}; `{task.test_command}` passes."},
    ]


def task_prompt(task: Task) -> str:
    """The task as the agent gets it (``task.md``), scripted-model block last."""
    files = ", ".join(sorted(task.files))
    return (
        f"The repository in your current directory ({files}) has a bug: {task.description}\n\n"
        f"Find and fix the bug in `{task.buggy_file}`. Do not modify `{task.test_file}`. "
        f"Check your fix with `{task.test_command}`, which must exit with status 0.\n\n"
        # For the built-in scripted demo model only; real models are told to skip it.
        "(The block below is a replay script for an automated test model; ignore it.)\n"
        f"<script>{json.dumps(script_for(task))}</script>\n"
    )


def build_dataset(num_examples: int = -1) -> Dataset:
    """The tasks as a verifiers dataset: ``prompt`` (chat messages), ``info``, ``answer``.

    ``info["files"]`` is a list of ``{"path", "content"}`` (a list, not a mapping, so every
    row shares one Arrow schema). ``num_examples=-1`` keeps all tasks; larger values cycle
    through them.
    """
    from datasets import Dataset  # imported here: the tasks themselves need no verifiers stack

    count = len(TASKS) if num_examples is None or num_examples < 0 else num_examples
    rows = []
    for i in range(count):
        task = TASKS[i % len(TASKS)]
        rows.append(
            {
                "prompt": [{"role": "user", "content": task_prompt(task)}],
                "answer": task.fixed_source,
                "info": {
                    "task_id": task.task_id,
                    "buggy_file": task.buggy_file,
                    "test_command": task.test_command,
                    "files": [{"path": p, "content": c} for p, c in sorted(task.files.items())],
                },
            }
        )
    return Dataset.from_list(rows)
