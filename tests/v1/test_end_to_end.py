"""v1 gateway mode end to end: scripted model, reference gateway, subprocess runtime.

A real v1 ``Agent`` runs the example agent (``fix_bug_v1``'s harness) as a subprocess
against the gateway on loopback, through :class:`GatewayInterception`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarness, FixBugHarnessConfig, FixBugTask, FixBugTaskset
from verifiers.v1.interception import InterceptionServer

from rollout_gateway.v1 import gateway_synced_agent

from .conftest import Stack, script_harness


def first_task() -> FixBugTask:
    return next(iter(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1"))))


async def run(stack: Stack, interception: Any, task: Any = None, *, sync: bool = True, **cfg: Any):
    agent = vf.Agent(stack.agent_config(FixBugHarnessConfig(), **cfg), interception=interception)
    if sync:
        gateway_synced_agent(agent, interception)
    async with agent:
        return await agent.run(task or first_task())


def expected_branch(steps: list[dict[str, Any]]) -> tuple[list[int], list[bool], list[float]]:
    """Token ids, sampled mask and sampled logprobs of the gateway's record."""
    last = steps[-1]["tokens"]
    ids = last["prompt_ids"] + last["completion_ids"]
    mask = [False] * len(ids)
    logprobs: list[float] = []
    for s in steps:
        start = len(s["tokens"]["prompt_ids"])
        for i in range(start, start + len(s["tokens"]["completion_ids"])):
            mask[i] = True
        logprobs += s["tokens"]["completion_logprobs"]
    return ids, mask, logprobs


async def test_multi_turn_tool_rollout_is_one_branch_equal_to_the_gateway_record(
    stack: Stack, make_interception: Any
) -> None:
    interception, spy = await make_interception()
    trace = await run(stack, interception)

    assert trace.ok and trace.stop_condition == "agent_completed"
    assert trace.rewards["tests_pass"].score == 1.0
    assert trace.num_turns == 4 and trace.num_branches == 1
    steps = spy.trajectories[-1]["trajectory"]
    assert len(steps) == 4
    ids, mask, logprobs = expected_branch(steps)
    branch = trace.branches[0]
    assert list(branch.token_ids) == ids
    assert list(branch.sampled_mask) == mask
    sampled = [lp for lp, m in zip(branch.logprobs, branch.sampled_mask, strict=True) if m]
    assert sampled == logprobs
    assert [c.finish_reason for c in trace.calls] == ["tool_calls"] * 3 + ["stop"]
    assert all(c.model == "scripted" and c.usage is not None for c in trace.calls)
    # Registered once, unregistered once, nothing cancelled, nothing left at the gateway;
    # the trajectory fetched once (at the harness's exit; the release needs no refetch).
    assert (spy.count("/register"), spy.count("/unregister"), spy.count("/cancel")) == (1, 1, 0)
    assert spy.count("/trajectory") == 1
    assert len(stack.gateway.registry) == 0


async def test_turn_refused_at_max_turns_is_the_stop_and_the_rollout_is_scored(
    stack: Stack, make_interception: Any
) -> None:
    interception, spy = await make_interception()
    trace = await run(stack, interception, max_turns=2)

    assert trace.ok, trace.errors
    assert trace.stop_condition == "max_turns" and trace.is_truncated
    assert trace.num_turns == 2
    assert "tests_pass" in trace.rewards  # scored (the fix landed on turn 2)
    register_body_limits = spy.trajectories[-1]["truncation_reason"]
    assert register_body_limits == "max_turns"
    assert len(stack.gateway.registry) == 0


async def test_v1_token_limit_is_enforced_at_the_gateway(
    stack: Stack, make_interception: Any
) -> None:
    interception, _ = await make_interception()
    trace = await run(stack, interception, max_output_tokens=1)

    assert trace.ok, trace.errors
    assert trace.stop_condition == "max_output_tokens"
    assert trace.num_turns == 1  # soft by one turn, as in v1: the crossing turn completes


# A harness whose program dies (exit 1) when the gateway refuses a turn, like v1's own
# chat loop does on any non-overflow API error.
_DYING_AGENT = """
import os, openai
client = openai.OpenAI()
messages = [{"role": "user", "content": "hello"}]
while True:
    answer = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "again"}]
"""


DyingHarness = script_harness("dying.py", _DYING_AGENT)


async def run_dying(stack: Stack, interception: Any, *, sync: bool) -> vf.Trace:
    config = stack.agent_config(FixBugHarnessConfig(), max_turns=2)
    agent = vf.Agent(config, interception=interception)
    agent.harness = DyingHarness(agent.harness.config)
    if sync:
        gateway_synced_agent(agent, interception)
    async with agent:
        return await agent.run(first_task())


async def test_harness_dying_on_a_refused_turn_ends_clean_with_the_hook(
    stack: Stack, make_interception: Any
) -> None:
    interception, _ = await make_interception()
    trace = await run_dying(stack, interception, sync=True)
    assert trace.ok, trace.errors
    assert trace.stop_condition == "max_turns"
    assert "tests_pass" in trace.rewards


async def test_without_the_sync_hook_v1_judges_the_exit_a_harness_error(
    stack: Stack, make_interception: Any
) -> None:
    # What the hook fixes (reproduces the issue): v1 checks the exit before the turns
    # arrive, so the refused turn looks like a crashed harness and nothing is scored.
    interception, _ = await make_interception()
    trace = await run_dying(stack, interception, sync=False)
    assert not trace.ok
    assert trace.errors[-1].type == "HarnessError"
    assert trace.rewards == {}


_SLOW_AGENT = """
import os, time, openai
client = openai.OpenAI()
client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                               messages=[{"role": "user", "content": "hi"}])
time.sleep(120)
"""


SlowHarness = script_harness("slow.py", _SLOW_AGENT)


async def test_cancelled_rollout_is_cancelled_and_unregistered_once(
    stack: Stack, make_interception: Any
) -> None:
    interception, spy = await make_interception()
    agent = vf.Agent(stack.agent_config(FixBugHarnessConfig()), interception=interception)
    agent.harness = SlowHarness(agent.harness.config)
    gateway_synced_agent(agent, interception)
    async with agent:
        running = asyncio.create_task(agent.run(first_task()))
        for _ in range(400):  # until the agent's one turn is recorded
            records = list(stack.gateway.registry._records.values())
            if records and records[0].num_turns == 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the agent never reached the gateway")
        running.cancel()
        try:
            await running
        except asyncio.CancelledError:
            pass
    assert (spy.count("/register"), spy.count("/cancel"), spy.count("/unregister")) == (1, 1, 1)
    assert len(stack.gateway.registry) == 0


class StoppingTask(FixBugTask):
    @vf.stop
    async def stop_early(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1


async def test_task_with_per_turn_hooks_is_refused_before_anything_registers(
    stack: Stack, make_interception: Any
) -> None:
    interception, spy = await make_interception()
    task = StoppingTask(first_task().data)
    trace = await run(stack, interception, task)
    assert not trace.ok
    error = trace.errors[-1]
    # v1's own TaskError, so v1's own stop name (not "gatewayfeature_error").
    assert error.type == "TaskError" and trace.stop_condition == "task_error"
    assert "@stop hooks on the live trace (stop_early)" in error.message
    assert spy.count("/register") == 0


async def test_fallback_runs_such_a_task_through_v1s_own_interception(
    stack: Stack, make_interception: Any
) -> None:
    # v1's own interception calls the run's client directly: here the model itself (the
    # reference gateway routes /v1/chat/completions by rollout key only), so the gateway
    # URL is configured explicitly.
    interception, spy = await make_interception(
        url=stack.gateway_url,
        fallback=True,
        fallback_interception=InterceptionServer(requires_tunnel=False),
    )
    task = StoppingTask(first_task().data)
    trace = await run(
        stack, interception, task, client=vf.EvalClientConfig(base_url=stack.model_url)
    )
    assert trace.ok, trace.errors
    assert trace.stop_condition == "stop_early"  # v1's own server ran the hook per turn
    assert spy.count("/register") == 0


# An agent whose SDK re-sends a turn (same Idempotency-Key, as after a lost answer).
_RETRYING_AGENT = """
import os, openai
client = openai.OpenAI()
body = dict(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": "hello"}])
first = client.chat.completions.create(**body, extra_headers={"Idempotency-Key": "turn-1"})
again = client.chat.completions.create(**body, extra_headers={"Idempotency-Key": "turn-1"})
assert again.id == first.id, (first.id, again.id)
"""


RetryingHarness = script_harness("retrying.py", _RETRYING_AGENT)


async def test_sdk_retry_of_a_turn_is_not_an_extra_turn_or_branch(
    stack: Stack, make_interception: Any
) -> None:
    interception, spy = await make_interception()
    agent = vf.Agent(stack.agent_config(FixBugHarnessConfig()), interception=interception)
    agent.harness = RetryingHarness(agent.harness.config)
    gateway_synced_agent(agent, interception)
    async with agent:
        trace = await agent.run(first_task())
    assert trace.ok, trace.errors
    assert trace.num_turns == 1 and trace.num_branches == 1 and len(trace.calls) == 1
    assert spy.trajectories[-1]["num_turns"] == 1


async def test_unreachable_gateway_fails_the_rollout_with_v1s_interception_error(
    stack: Stack, make_interception: Any
) -> None:
    interception, spy = await make_interception(url="http://127.0.0.1:9")  # nothing listens
    trace = await run(stack, interception)
    assert not trace.ok
    assert trace.errors[-1].type == "InterceptionError"
    assert trace.stop_condition == "interception_error"  # v1's name for its boundary
    assert trace.num_turns == 0 and trace.rewards == {}


def test_the_sync_hook_keeps_v1s_resume_support_check() -> None:
    # v1 reads "the class overrides resume" as native resume support: the synced class
    # must override it only where the harness class itself does.
    from verifiers.v1.harness import Harness

    from rollout_gateway.v1 import gateway_synced

    class Host:  # stands in for the interception (only its identity is used here)
        pass

    host = Host()
    synced = gateway_synced(FixBugHarness(FixBugHarnessConfig()), host)  # type: ignore[arg-type]
    assert type(synced).resume is Harness.resume
    assert isinstance(synced, FixBugHarness)
