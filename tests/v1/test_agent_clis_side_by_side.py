"""The real Claude Code and Codex CLIs on v1, side by side: the same task, model and
limits through v1's own interception and through the gateway, each CLI in a contained
``local_sandbox`` runtime that sees its install read-only.

v1's own interception relays a Messages or Responses call natively (its eval client), so
its upstream must speak that dialect: a rollout of the same gateway, in front of the same
scripted model. What a trainer reads must agree: the stop, every model call's messages
and tool calls, the reward; and the gateway's trace carries the token ids the engine
served (the same ids the upstream rollout recorded for v1's own run).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import verifiers.v1 as vf
from agent_clis.support import program_of
from fix_bug_v1 import FixBugHarnessConfig, FixBugTaskset
from verifiers.v1.interception import InterceptionServer

from rollout_gateway.agent_clis import AGENT_CLIS, AgentCli
from rollout_gateway.demo.agents import DemoAgent
from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import (
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
    gateway_synced_agent,
)

from .conftest import ADMIN_TOKEN, SANDBOX_ROOT, Stack

UPSTREAM_KEY_VAR = "RG_SIDE_BY_SIDE_UPSTREAM_KEY"


def agent_config(stack: Stack, cli: AgentCli, base_url: str, **client: Any) -> Any:
    agent = DemoAgent(cli, program_of(cli))
    root = SANDBOX_ROOT
    return LocalSandboxAgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=base_url, **client),
        harness=FixBugHarnessConfig(command=agent.command()),
        runtime=LocalSandboxRuntimeConfig(
            isolation="bwrap", root=str(root), read_only=agent.read_only
        ),
    )


def first_task() -> Any:
    return next(iter(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1"))))


@contextlib.asynccontextmanager
async def upstream_rollout(stack: Stack) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """A gateway rollout as v1's own interception's upstream (Messages and Responses in
    front of the scripted model); its key in ``UPSTREAM_KEY_VAR``."""
    rollout_id = f"upstream-{os.urandom(4).hex()}"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers) as control:
        r = await control.post(f"/v1/rollouts/{rollout_id}/register", json={"model": "scripted"})
        r.raise_for_status()
        os.environ[UPSTREAM_KEY_VAR] = r.json()["api_key"]
        try:
            yield rollout_id, control
        finally:
            os.environ.pop(UPSTREAM_KEY_VAR, None)


def calls_of(trace: vf.Trace) -> list[dict[str, Any]]:
    """Each model call: the assistant's message (text, tool calls) and its prompt."""
    calls = []
    for call in trace.calls:
        assert call.node is not None, call
        node = trace.nodes[call.node]
        message = node.message.model_dump(exclude_none=True)
        calls.append(
            {
                "content": message.get("content"),
                "tools": [(c["name"], c["arguments"]) for c in message.get("tool_calls", [])],
                "finish": call.finish_reason,
            }
        )
    return calls


#: What differs between two runs of the same CLI on the same task, each with what it is
#: made the same as: a local sandbox's id (in the CLI's working directory, which Claude
#: Code's prompts carry), and what Codex's exec_command reports besides the output (a
#: random chunk id, the wall time).
RUN_SPECIFIC = (
    (re.compile(r"local-[0-9a-f]{20}"), "local-SANDBOX"),
    (re.compile(r"Chunk ID: [0-9a-f]+"), "Chunk ID: C"),
    (re.compile(r"Wall time: [0-9.]+ seconds"), "Wall time: T seconds"),
)


def branch_messages(trace: vf.Trace) -> list[Any]:
    """Each branch's messages (the prompts and answers a trainer sees), with what is
    specific to one run made the same (:data:`RUN_SPECIFIC`). Left out, by design (see
    ``tests/server/dialects/test_v1_parity.py``): a tool message's ``name`` (v1's own
    Anthropic and Responses parsers leave it empty, the gateway names the tool) and an
    assistant's ``provider_state`` (v1 keeps a Responses answer's whole output items, the
    gateway only items that carry state; v1's message identity reads only those)."""
    branches = [
        [
            m.model_dump(mode="json", exclude_none=True, exclude={"name", "provider_state"})
            for m in b.messages
        ]
        for b in trace.branches
    ]
    text = json.dumps(branches)
    for pattern, same in RUN_SPECIFIC:
        text = pattern.sub(same, text)
    return json.loads(text)


def completion_ids(trace: vf.Trace) -> list[list[int]]:
    """The sampled token ids of each call's assistant node."""
    out = []
    for call in trace.calls:
        node = trace.nodes[call.node]
        out.append([t for t, m in zip(node.token_ids, node.mask, strict=True) if m])
    return out


async def run_both_ways(
    stack: Stack, make_interception: Any, config_for: Callable[..., Any]
) -> tuple[Any, Any, list[list[int]]]:
    """The first task run twice: by v1's own interception in front of a rollout registered
    upstream (the gateway as v1's engine), and in gateway mode. ``config_for(base_url,
    **client)`` makes the agent's config for a model URL. Returns v1's own run, the
    gateway-mode run and the completion ids the engine served to v1's own run."""
    async with upstream_rollout(stack) as (rollout_id, control):
        own_config = config_for(
            f"{stack.gateway_url}/v1/rollouts/{rollout_id}", api_key_var=UPSTREAM_KEY_VAR
        )
        async with InterceptionServer(requires_tunnel=False) as server:
            async with vf.Agent(own_config, interception=server) as agent:
                own = await agent.run(first_task())
        upstream = (await control.get(f"/v1/rollouts/{rollout_id}/trajectory")).json()

    interception, _ = await make_interception()
    agent = vf.Agent(config_for(f"{stack.gateway_url}/v1"), interception=interception)
    gateway_synced_agent(agent, interception)
    async with agent:
        through_gateway = await agent.run(first_task())
    served = [s["tokens"]["completion_ids"] for s in upstream["trajectory"]]
    return own, through_gateway, served


def assert_same_run(own: Any, through_gateway: Any, served: list[list[int]], shell: str) -> None:
    """Both runs of :func:`run_both_ways` ended alike: ok, the same stop and rewards, the
    same model calls (the agent's shell tool ``shell`` only), and token-exact: the
    gateway's trace holds what the engine served, the same ids the upstream rollout
    recorded for v1's own run (whose eval client carries none)."""
    assert own.ok and through_gateway.ok, (own.errors, through_gateway.errors)
    assert through_gateway.stop_condition == own.stop_condition
    assert through_gateway.rewards == own.rewards and own.rewards
    assert calls_of(through_gateway) == calls_of(own)
    assert {t[0] for c in calls_of(own) for t in c["tools"]} == {shell}
    assert completion_ids(through_gateway) == served


@pytest.mark.parametrize("name", list(AGENT_CLIS))
async def test_the_cli_through_the_gateway_matches_v1s_own_interception(
    stack: Stack, make_interception: Any, name: str
) -> None:
    reason = unavailable_reasons()[IsolationMode.BWRAP]
    if reason is not None:
        pytest.skip(f"bwrap unavailable here: {reason}")
    cli = AGENT_CLIS[name]
    own, through_gateway, served = await run_both_ways(
        stack,
        make_interception,
        lambda base_url, **client: agent_config(stack, cli, base_url, **client),
    )

    assert_same_run(
        own, through_gateway, served, {"claude-code": "Bash", "codex": "exec_command"}[name]
    )
    assert branch_messages(through_gateway) == branch_messages(own)
