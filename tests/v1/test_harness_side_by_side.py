"""verifiers 0.4.0's own harnesses (``verifiers.v1.harnesses``) on the ``local_sandbox``
runtime, side by side: the same task, model and limits through v1's own interception and
through the gateway, each harness installed by its own ``setup`` into the per-machine
harness cache (:mod:`rollout_gateway.local_sandbox.harness_cache`) that every sandbox
sees read-only.

As in ``test_agent_clis_side_by_side.py``, v1's own interception relays to a gateway
rollout in front of the same scripted model, so both runs meet the same engine and the
upstream rollout's record gives the token ids v1's own run was served. What a trainer
reads must agree: the stop, each model call's text and tool calls, every branch's
messages, the reward, and the token ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import verifiers.v1 as vf
from fix_bug_v1 import FixBugTask
from fix_bug_v1.tasks import FixBugData
from verifiers.v1.harnesses import BashHarnessConfig, MiniSWEAgentHarnessConfig
from verifiers.v1.interception import InterceptionServer

from rollout_gateway.examples.fix_bug_env.tasks import TASKS, script_for
from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import (
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
    gateway_synced_agent,
)

from .conftest import SANDBOX_ROOT, Stack
from .test_agent_clis_side_by_side import (
    UPSTREAM_KEY_VAR,
    branch_messages,
    calls_of,
    completion_ids,
    upstream_rollout,
)


def task_for(tool: str, argument: str, last: dict[str, Any] | None = None) -> FixBugTask:
    """The first fix-the-bug task, its script's shell steps on the harness's own shell
    tool (``tool``, the command in ``argument``); ``last`` replaces the closing answer."""
    steps = json.loads(json.dumps(script_for(TASKS[0])))
    for step in steps:
        if step.get("tool") == "run_shell":
            step["tool"] = tool
            step["arguments"] = {argument: step["arguments"]["command"]}
    if last is not None:
        steps[-1] = last
    return scripted_task(steps)


def scripted_task(steps: list[dict[str, Any]]) -> FixBugTask:
    """The first fix-the-bug task, the scripted model following ``steps``."""
    task = TASKS[0]
    prompt = (
        f"Fix the bug in `{task.buggy_file}`: {task.description} "
        f"Check with `{task.test_command}`.\n<script>{json.dumps(steps)}</script>\n"
    )
    data = FixBugData(
        id=task.task_id,
        name=task.task_id,
        prompt=prompt,
        files=dict(task.files),
        test_command=task.test_command,
    )
    return FixBugTask(data, vf.TaskConfig())


def agent_config(
    harness: Any, base_url: str, runtime: dict[str, Any] | None = None, **client: Any
) -> LocalSandboxAgentConfig:
    """The agent's config: ``harness`` on a ``bwrap`` sandbox (``runtime``: more runtime
    settings) with the scripted model at ``base_url``."""
    return LocalSandboxAgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=base_url, **client),
        harness=harness,
        runtime=LocalSandboxRuntimeConfig(isolation="bwrap", root=SANDBOX_ROOT, **(runtime or {})),
    )


async def side_by_side(
    stack: Stack,
    make_interception: Any,
    harness: Any,
    task: FixBugTask,
    runtime: dict[str, Any] | None = None,
) -> tuple[vf.Trace, vf.Trace, list[list[int]]]:
    """(v1's own run, the gateway's run, the ids the engine served v1's own run)."""
    if (reason := unavailable_reasons()[IsolationMode.BWRAP]) is not None:
        pytest.skip(f"bwrap unavailable here: {reason}")
    async with upstream_rollout(stack) as (rollout_id, control):
        own_config = agent_config(
            harness,
            f"{stack.gateway_url}/v1/rollouts/{rollout_id}",
            runtime,
            api_key_var=UPSTREAM_KEY_VAR,
        )
        async with InterceptionServer(requires_tunnel=False) as server:
            async with vf.Agent(own_config, interception=server) as agent:
                own = await agent.run(task)
        upstream = (await control.get(f"/v1/rollouts/{rollout_id}/trajectory")).json()

    interception, _ = await make_interception()
    agent = vf.Agent(
        agent_config(harness, f"{stack.gateway_url}/v1", runtime), interception=interception
    )
    gateway_synced_agent(agent, interception)
    async with agent:
        through_gateway = await agent.run(task)
    served = [s["tokens"]["completion_ids"] for s in upstream["trajectory"]]
    return own, through_gateway, served


def assert_same(
    own: vf.Trace,
    through_gateway: vf.Trace,
    served: list[list[int]],
    messages: Callable[[vf.Trace], list[Any]] = branch_messages,
) -> None:
    """Both runs ended alike and the gateway's trace is token-exact. ``messages`` reads
    a trace's messages for the comparison (:func:`branch_messages`, or a harness's own
    reading that also makes the same what its environment shows by chance)."""
    assert own.ok and through_gateway.ok, (own.errors, through_gateway.errors)
    assert through_gateway.stop_condition == own.stop_condition
    assert through_gateway.rewards == own.rewards
    assert calls_of(through_gateway) == calls_of(own)
    assert messages(through_gateway) == messages(own)
    assert completion_ids(through_gateway) == served


async def test_bash_harness_through_the_gateway_matches_v1s_own_interception(
    stack: Stack, make_interception: Any
) -> None:
    own, through_gateway, served = await side_by_side(
        stack, make_interception, BashHarnessConfig(), task_for("bash", "command")
    )
    assert_same(own, through_gateway, served)
    # The scripted fix ran through the harness's own bash tool: the test passes.
    assert own.rewards and all(r.score == 1.0 for r in own.rewards.values()), own.rewards
    assert {t[0] for c in calls_of(own) for t in c["tools"]} == {"bash"}


#: mini-swe-agent ends when a command prints this (its own rule); a text answer would
#: only get a format error back.
MINI_SUBMIT = {
    "tool": "bash",
    "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"},
}


async def test_mini_swe_agent_harness_through_the_gateway_matches_v1s_own_interception(
    stack: Stack, make_interception: Any
) -> None:
    # litellm would fetch its model price list from GitHub at import (not reachable from
    # CI); its documented switch keeps the bundled copy.
    harness = MiniSWEAgentHarnessConfig(
        id="mini_swe_agent", env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    )
    task = task_for("bash", "command", last=MINI_SUBMIT)
    own, through_gateway, served = await side_by_side(stack, make_interception, harness, task)
    assert_same(own, through_gateway, served)
    assert own.rewards and all(r.score == 1.0 for r in own.rewards.values()), own.rewards
    assert len(own.calls) == 4
