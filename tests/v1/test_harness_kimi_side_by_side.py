"""verifiers 0.4.0's ``kimi_code`` harness (Kimi Code's own ACP server, ``kimi acp``) on
the ``local_sandbox`` runtime, side by side: the same task, model and limits through
v1's own interception and through the gateway (as ``test_harness_node_side_by_side.py``).

The harness's own install fetches Moonshot's installer from code.kimi.com, which CI
cannot reach. The same release (the harness's pin, 2.0.2) is on the npm registry
(``@moonshot-ai/kimi-code``): :func:`rollout_gateway.v1.harness_kimi.provide_kimi_code`
installs it once per machine and every sandbox sees it read-only at
``/tmp/vf-kimi-code``, where the harness's ready check (``bin/kimi --version`` prints the
pin) accepts it, so the harness's own install step is skipped.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import verifiers.v1 as vf
from verifiers.v1.harnesses.kimi_code import KimiCodeHarnessConfig

from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import LocalSandboxAgentConfig, LocalSandboxRuntimeConfig
from rollout_gateway.v1.harness_kimi import KimiCodeInstall, provide_kimi_code

from .conftest import SANDBOX_ROOT, Stack
from .test_agent_clis_side_by_side import assert_same_run, calls_of, run_both_ways
from .test_harness_node_side_by_side import FORWARD, REQUIRE_VAR, messages_of


def installed(config: KimiCodeHarnessConfig) -> KimiCodeInstall:
    """Kimi Code from npm, once per machine (skips without npm; fails under CI)."""
    if shutil.which("npm") is None:
        message = "SKIPPED: npm is needed to provide Kimi Code (@moonshot-ai/kimi-code)"
        if os.environ.get(REQUIRE_VAR) == "1":
            pytest.fail(message)
        pytest.skip(message)
    return provide_kimi_code(config.version)


def agent_config(
    config: KimiCodeHarnessConfig, install: KimiCodeInstall, base_url: str, **client: Any
) -> LocalSandboxAgentConfig:
    """``config`` in a ``bwrap`` sandbox that sees Kimi Code read-only."""
    runtime = LocalSandboxRuntimeConfig(
        isolation="bwrap",
        root=SANDBOX_ROOT,
        read_only=install.read_only,
        read_only_at=install.read_only_at,
    )
    return LocalSandboxAgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=base_url, **client),
        harness=config,
        runtime=runtime,
    )


@pytest.mark.parametrize("transport", ["chat_completions", "responses", "anthropic_messages"])
async def test_kimi_code_harness_through_the_gateway_matches_v1s_own_interception(
    stack: Stack, make_interception: Any, transport: Any
) -> None:
    reason = unavailable_reasons()[IsolationMode.BWRAP]
    if reason is not None:
        pytest.skip(f"bwrap unavailable here: {reason}")
    config = KimiCodeHarnessConfig(id="kimi_code", transport=transport, forward_env=FORWARD)
    install = installed(config)
    own, through_gateway, served = await run_both_ways(
        stack,
        make_interception,
        lambda base_url, **client: agent_config(config, install, base_url, **client),
    )

    assert_same_run(own, through_gateway, served, "Bash")
    assert messages_of(through_gateway) == messages_of(own)
    # Kimi Code's own Bash tool ran the scripted fix: the task's test passes.
    assert all(r.score == 1.0 for r in own.rewards.values()), own.rewards
    assert len(calls_of(own)) == 4, calls_of(own)
