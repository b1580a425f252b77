"""Test helpers shared by the mixin tests: an env as authors write it, agents, rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import verifiers as vf
from core_world import no_wait
from datasets import Dataset
from prime_sandboxes import CreateSandboxRequest

from rollout_gateway import RolloutGatewayMixin
from rollout_gateway.client import RetryPolicy
from rollout_gateway.polling import PollPolicy
from rollout_gateway.testing import FakeGateway, FakeSandbox, rollout_id_of, task_row

GATEWAY_BASE_URL = "http://gateway.test:8000/v1"
FAST_RETRY = RetryPolicy(
    max_attempts=3, initial_backoff=0.0, max_backoff=0.0, jitter=0.0, sleep=no_wait
)
FAST_POLL = PollPolicy(min_interval=0.005, max_interval=0.02)


def task_dataset(n: int = 2) -> Dataset:
    """Tiny task rows in verifiers' input format."""
    return Dataset.from_list([task_row(i) for i in range(n)])


class GatewayTestEnv(RolloutGatewayMixin, vf.CliAgentEnv):
    """An env as an author writes it: post_rollout checks the sandbox, rubric rewards."""

    use_gateway = True

    def __init__(self, **kwargs: Any) -> None:
        async def solved(state: vf.State) -> float:
            return 1.0 if state.get("tests_passed") else 0.0

        super().__init__(
            run_command="python agent.py",
            dataset=task_dataset(),
            rubric=vf.Rubric(funcs=[solved]),
            **kwargs,
        )
        self.post_rollout_calls = 0

    async def post_rollout(self, state: vf.State) -> None:
        self.post_rollout_calls += 1
        result = await self.sandbox_client.execute_command(state["sandbox_id"], "cat result.txt")
        state["tests_passed"] = result.exit_code == 0 and result.stdout.strip() == "PASS"
        await super().post_rollout(state)


def two_turn_agent(gateway: FakeGateway) -> Callable[[FakeSandbox], Any]:
    """An agent that makes two tool-using turns through the gateway and passes the test."""

    async def agent(sandbox: FakeSandbox) -> int:
        rid = rollout_id_of(sandbox)
        user = {"role": "user", "content": "Fix the bug"}
        call = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": '{"command": "make fix"}'},
                }
            ],
        }
        tool = {"role": "tool", "tool_call_id": "c1", "content": "fixed"}
        done = {"role": "assistant", "content": "Done."}
        gateway.add_turn(rid, [user], [call], tokens=tokens([1, 2, 3], [4, 5]))
        gateway.add_turn(rid, [user, call, tool], [done], tokens=tokens([1, 2, 3, 4, 5, 6], [7]))
        sandbox.files["result.txt"] = "PASS"
        return 0

    return agent


def tokens(prompt_ids: list[int], completion_ids: list[int]) -> dict[str, Any]:
    """A step token record as the gateway sends it."""
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": [0] * len(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": [1] * len(completion_ids),
        "completion_logprobs": [-0.5] * len(completion_ids),
        "overlong_prompt": False,
        "is_truncated": False,
    }


def cli_agent_env_request(**overrides: Any) -> CreateSandboxRequest:
    """A ``CreateSandboxRequest`` with exactly the keywords ``CliAgentEnv.setup_state`` passes.

    verifiers 0.3.1 passes a string ``start_command`` and a ``vm`` flag; prime-sandboxes
    0.3.0 and later reject both, so building this is the pin's guard.
    """
    fields: dict[str, Any] = {
        "name": "rollout_x",
        "docker_image": "python:3.11-slim",
        "start_command": "tail -f /dev/null",
        "cpu_cores": 1,
        "memory_gb": 2,
        "disk_size_gb": 5,
        "gpu_count": 0,
        "gpu_type": None,
        "vm": False,
        "timeout_minutes": 60,
        "environment_vars": {"OPENAI_BASE_URL": "http://x"},
        "team_id": None,
        "advanced_configs": None,
        "labels": [],
    }
    fields.update(overrides)
    return CreateSandboxRequest(**fields)
