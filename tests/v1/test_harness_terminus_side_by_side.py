"""verifiers 0.4.0's ``terminus_2`` harness (Harbor's Terminus 2 driving a tmux shell) on
the ``local_sandbox`` runtime, side by side: the same task, model and limits through
v1's own interception and through the gateway (as ``test_harness_side_by_side.py``).

Harbor 0.23.0 needs Python >= 3.12. uv would download one from GitHub, which CI cannot
reach; the harness cache builds the harness's environment on a Python >= 3.12 found on
the host instead (the runtime's ``harness_python``, found by
:func:`rollout_gateway.v1.harness_python.find_python`: ``PATH``, then pyenv's usual
places). Without one the test skips, saying so.

Terminus answers in text, not tool calls: the scripted model says Terminus's JSON (its
``commands`` typed into the tmux shell), then ``task_complete`` twice (Terminus asks to
confirm).

Harbor's Terminus reads the screen the first time right after it starts the tmux session,
without waiting for the shell: the first prompt shows ``bash-5.2$`` or not, by chance (a
race in Harbor, in either run). :func:`terminus_messages` makes that first screen the
same; every later screen must match as it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import verifiers.v1 as vf
from verifiers.v1.harnesses import Terminus2HarnessConfig

from rollout_gateway.v1.harness_python import find_python

from .conftest import Stack
from .test_agent_clis_side_by_side import branch_messages, calls_of
from .test_harness_side_by_side import assert_same, scripted_task, side_by_side

#: The fix and the task's own check, typed into Terminus's shell; each waits long enough
#: for the command to end (the screen Terminus reads back must not depend on timing).
FIX = (
    'python3 -c \'import pathlib; p = pathlib.Path("calc.py"); '
    'p.write_text(p.read_text().replace("return a - b", "return a + b"))\'\n'
)


def terminus_answer(commands: list[str], complete: bool) -> dict[str, str]:
    """A scripted ``say`` step: Terminus's JSON answer typing ``commands``."""
    answer = {
        "analysis": "calc.add subtracts." if not complete else "The test passes.",
        "plan": "Fix it and run the test." if not complete else "Done.",
        "commands": [{"keystrokes": c, "duration": 3.0} for c in commands],
        "task_complete": complete,
    }
    return {"say": json.dumps(answer)}


#: The first screen, which Terminus reads before the shell may have drawn its prompt.
FIRST_SCREEN = re.compile(
    r"(Current terminal state:\nCurrent Terminal Screen:\n)(?:bash-[0-9.]+\$)?"
)


def terminus_messages(trace: vf.Trace) -> list[Any]:
    """:func:`branch_messages`, with the first screen's shell prompt (drawn or not yet
    drawn when Terminus read it) made the same."""
    branches = branch_messages(trace)
    for messages in branches:
        first = messages[0]
        first["content"], found = FIRST_SCREEN.subn(r"\1PROMPT", first["content"], count=1)
        assert found, f"no first screen in Terminus's first prompt: {first['content'][-500:]!r}"
    return branches


STEPS = [
    terminus_answer([FIX, "python3 test_calc.py\n"], complete=False),
    terminus_answer([], complete=True),
    terminus_answer([], complete=True),
]


async def test_terminus_2_harness_through_the_gateway_matches_v1s_own_interception(
    stack: Stack, make_interception: Any
) -> None:
    python = find_python((3, 12))
    if python is None:
        pytest.skip(
            "terminus_2 (Harbor 0.23.0) needs a Python >= 3.12: none on PATH nor in "
            "~/.pyenv/versions (uv cannot download one here)"
        )
    # litellm would fetch its price list from GitHub when it starts (as mini_swe_agent).
    harness = Terminus2HarnessConfig(id="terminus_2", env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    own, through_gateway, served = await side_by_side(
        stack, make_interception, harness, scripted_task(STEPS), {"harness_python": python}
    )
    assert_same(own, through_gateway, served, messages=terminus_messages)
    # Terminus's shell ran the scripted fix: the task's test passes; three model calls.
    assert own.rewards and all(r.score == 1.0 for r in own.rewards.values()), own.rewards
    assert len(calls_of(own)) == 3
    screens = json.dumps(branch_messages(own))
    assert "OK" in screens or "passed" in screens.lower(), screens[-2000:]
