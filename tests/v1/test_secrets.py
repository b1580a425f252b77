"""No credential of the env reaches a v1 agent, on the ``local_sandbox`` runtime and on v1's
own ``subprocess`` runtime: the agent dumps its whole environment, ``/proc/self/environ``,
its command line and its files, and none of the env's secrets is there."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarness, FixBugHarnessConfig, FixBugTaskset
from verifiers.v1.runtimes import SubprocessConfig

from rollout_gateway.admin_token import take_admin_token
from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import (
    GatewayInterception,
    GatewayInterceptionConfig,
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
    gateway_synced_agent,
)

from .conftest import ADMIN_TOKEN, FAST_RETRY, Stack

OTHER_SECRET = "sk-env-process-secret-31337"

DUMP = r"""
import os, sys
print("ENV", dict(os.environ))
print("PROC_ENVIRON", open("/proc/self/environ", "rb").read())
print("CMDLINE", open("/proc/self/cmdline", "rb").read(), sys.argv)
for dirpath, _, names in os.walk(os.getcwd()):  # the agent's own files
    for name in names:
        path = os.path.join(dirpath, name)
        try:
            print("FILE", path, open(path, "rb").read(1 << 20))
        except OSError:
            pass
"""


class DumpHarness(FixBugHarness):
    outputs: list[str] = []

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):  # type: ignore[override]
        await runtime.write("dump.py", DUMP.encode())
        env = {"OPENAI_BASE_URL": endpoint, "OPENAI_API_KEY": secret, "OPENAI_MODEL": ctx.model}
        result = await runtime.run_program([sys.executable, "dump.py"], env)
        DumpHarness.outputs.append(result.stdout + result.stderr)
        return result


@pytest.mark.parametrize("runtime_kind", ["subprocess", "local_sandbox"])
@pytest.mark.parametrize("hand_over", ["variable", "file"])
async def test_no_env_secret_reaches_the_agent(
    stack: Stack,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    runtime_kind: str,
    hand_over: str,
) -> None:
    if runtime_kind == "local_sandbox":
        reason = unavailable_reasons()[IsolationMode.BWRAP]
        if reason is not None:
            pytest.skip(f"bwrap unavailable here: {reason}")
        root = Path("/tmp") / f"rg-secrets-{os.getpid()}-{hand_over}"
        runtime: Any = LocalSandboxRuntimeConfig(isolation="bwrap", root=str(root))
    else:
        runtime = SubprocessConfig()
    token_file = tmp_path / "admin-token"
    if hand_over == "file":
        token_file.write_text(ADMIN_TOKEN + "\n")
        token_file.chmod(0o600)
        monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", str(token_file))
    else:
        monkeypatch.setenv("ROLLOUT_GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("SOME_SERVICE_API_KEY", OTHER_SECRET)  # v1 drops *API_KEY* itself
    DumpHarness.outputs = []
    # The interception reads the token from the environment (no admin_token argument).
    interception = GatewayInterception(GatewayInterceptionConfig(tunnel="direct"), retry=FAST_RETRY)
    assert "ROLLOUT_GATEWAY_ADMIN_TOKEN" not in os.environ
    assert "ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE" not in os.environ
    assert take_admin_token() == ADMIN_TOKEN  # still known to the env process
    config = LocalSandboxAgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=f"{stack.gateway_url}/v1"),
        harness=FixBugHarnessConfig(),
        runtime=runtime,
    )
    async with interception:
        agent = vf.Agent(config, interception=interception)
        agent.harness = DumpHarness(agent.harness.config)
        gateway_synced_agent(agent, interception)
        task = next(iter(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1"))))
        async with agent:
            await agent.run(task)
    with contextlib.suppress(OSError):
        os.rmdir(Path("/tmp") / f"rg-secrets-{os.getpid()}-{hand_over}")
    (dump,) = DumpHarness.outputs
    assert "PROC_ENVIRON" in dump and "CMDLINE" in dump, dump[-2000:]
    assert "OPENAI_API_KEY" in dump  # the rollout's own key: that one it needs
    for secret in (ADMIN_TOKEN, OTHER_SECRET, "ROLLOUT_GATEWAY_ADMIN_TOKEN", str(token_file)):
        assert secret not in dump, f"{secret!r} reached the agent"
    assert stack.gateway.metrics.registrations.value() == 1  # the token did its job
