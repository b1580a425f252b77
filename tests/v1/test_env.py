"""The ``gateway`` interception type of a v1 env's config, and ``vf-eval`` in gateway mode."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from fix_bug_v1 import FixBugEnv
from pydantic import ValidationError
from verifiers.v1.interception import ElasticInterceptionPoolConfig
from verifiers.v1.utils.loaders import environment_class, resolve_env_config

from rollout_gateway import child_processes
from rollout_gateway.v1 import GatewayEnvConfig, GatewayInterceptionConfig

from .conftest import ADMIN_TOKEN, Stack


def test_taskset_id_selects_the_gateway_capable_env_and_config() -> None:
    assert environment_class("fix-bug-v1") is FixBugEnv
    config = resolve_env_config(
        {
            "taskset": {"id": "fix-bug-v1"},
            "interception": {"type": "gateway", "url": "http://gw:8000/v1", "tunnel": "prime"},
        }
    )
    assert isinstance(config, GatewayEnvConfig)
    assert isinstance(config.interception, GatewayInterceptionConfig)
    assert (config.interception.url, config.interception.tunnel) == ("http://gw:8000/v1", "prime")


def test_other_interception_types_still_validate() -> None:
    config = resolve_env_config({"taskset": {"id": "fix-bug-v1"}})
    assert isinstance(config.interception, ElasticInterceptionPoolConfig)
    served = resolve_env_config(
        {"taskset": {"id": "fix-bug-v1"}, "interception": {"type": "server"}}
    )
    assert served.interception.type == "server"


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "gateway", "url": "gw:8000"},
        {"type": "gateway", "tunnel": "ssh"},
        {"type": "gateway", "port": 0},
        {"type": "tunnelled"},
    ],
)
def test_bad_gateway_options_are_refused_at_config_time(bad) -> None:
    with pytest.raises(ValidationError):
        resolve_env_config({"taskset": {"id": "fix-bug-v1"}, "interception": bad})


async def test_vf_eval_runs_the_example_in_gateway_mode(stack: Stack, tmp_path: Path) -> None:
    vf_eval = Path(sys.executable).with_name("vf-eval")
    env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN, "NO_COLOR": "1"}
    process = await child_processes.spawn_async(  # dies with this process
        str(vf_eval),
        "fix-bug-v1",
        "-m",
        "scripted",
        "--client.base-url",
        f"{stack.gateway_url}/v1",
        "--env.agent.runtime.type",
        "subprocess",
        "--env.interception.type",
        "gateway",
        "--env.interception.tunnel",
        "direct",
        "--no-push",
        "-n",
        "2",
        "-o",
        str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=240)
    assert process.returncode == 0, output.decode()[-3000:]
    episodes = [
        json.loads(line)
        for path in tmp_path.rglob("traces.jsonl")
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    assert len(episodes) == 2  # two tasks, one rollout each
    for episode in episodes:
        (trace,) = episode["traces"]
        assert episode["ok"] and trace["stop_condition"] == "agent_completed"
        assert trace["rewards"]["tests_pass"]["score"] == 1.0
        assert len(trace["calls"]) == 4
    # Every rollout went through the gateway, and none is left registered there.
    assert stack.gateway.metrics.registrations.value() == 2
    assert len(stack.gateway.registry) == 0


def test_env_id_selects_the_ready_gateway_env_for_any_taskset() -> None:
    from rollout_gateway.v1 import GatewayEnv

    assert environment_class("fix-bug-v1", "rollout-gateway-env") is GatewayEnv
    config = resolve_env_config(
        {
            "id": "rollout-gateway-env",
            "taskset": {"id": "fix-bug-v1"},
            "interception": {"type": "gateway"},
        }
    )
    assert isinstance(config, GatewayEnvConfig)
    assert isinstance(config.interception, GatewayInterceptionConfig)
