"""verifiers 0.4's own Node harnesses (``claude_code``, ``codex``, ``pi``: ACP adapters
over the real CLIs) on the ``local_sandbox`` runtime, side by side: the same task, model
and limits through v1's own interception and through the gateway.

Each harness's own ``setup()`` runs in every rollout, as v1 runs it. What it installs
(Node.js, the CLI and its ACP adapter under ``/var/tmp/vf-*``) is installed once per
machine, on the host, by the harness's own install step
(:func:`rollout_gateway.v1.harness_node.install_on_host`), and every sandbox sees it
read-only at the same path, where the harness's ready check finds it. Node.js itself
cannot come from nodejs.org here (v1's ``ensure_node`` downloads it): the npm package
of the same build provides it where ``ensure_node``'s check accepts it
(:func:`rollout_gateway.v1.harness_node.provide_node`).

What a trainer reads must agree, as in ``test_agent_clis_side_by_side.py``: the stop,
every model call's messages and tool calls, the reward; and the gateway's trace carries
the token ids the engine served.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import verifiers.v1 as vf
from verifiers.v1.harnesses.claude_code import ClaudeCodeHarnessConfig
from verifiers.v1.harnesses.codex import CodexHarnessConfig
from verifiers.v1.harnesses.pi import PiHarnessConfig
from verifiers.v1.harnesses.pi import harness as pi_harness

from rollout_gateway.local_sandbox import IsolationMode, unavailable_reasons
from rollout_gateway.v1 import (
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
    harness_node,
)

from .conftest import SANDBOX_ROOT, Stack
from .test_agent_clis_side_by_side import assert_same_run, branch_messages, run_both_ways

#: Set by CI (``.ci/run``): a harness that cannot be installed fails instead of skipping.
REQUIRE_VAR = "ROLLOUT_GATEWAY_REQUIRE_AGENT_CLIS"

#: What the ACP runner's uv needs to reach PyPI from a sandbox (the host's CA bundle),
#: forwarded explicitly as an env author would: nothing else of the host's reaches it.
FORWARD = ["SSL_CERT_FILE"]

#: Each harness's config and the shell tool the scripted model drives in it.
HARNESSES: dict[str, tuple[Any, str]] = {
    "claude_code": (ClaudeCodeHarnessConfig(id="claude_code", forward_env=FORWARD), "Bash"),
    "codex": (CodexHarnessConfig(id="codex", forward_env=FORWARD), "exec_command"),
    **{
        f"pi-{transport}": (
            PiHarnessConfig(id="pi", transport=transport, forward_env=FORWARD),
            "bash",
        )
        for transport in ("chat_completions", "responses", "anthropic_messages")
    },
}


#: pi's packages as v1 0.4.0 pins them (``verifiers.v1.harnesses.pi``), and the nearest
#: published versions of the two the npm registry does not have (``npm install
#: pi-acp@0.0.33`` -> ``ETARGET No matching version found``; pi-mcp-adapter 2.34.0 alike).
PI_SUBSTITUTES = {"pi-mcp-adapter": "2.36.0", "pi-acp": "0.0.34"}


def provide_pi(config: PiHarnessConfig) -> None:
    """Where v1's pinned pi packages cannot be fetched, install the nearest published
    ones into pi's directory and record v1's pins in its ``.versions`` (the check that
    makes v1's install skip npm): the test says so, see :data:`PI_SUBSTITUTES`."""
    packages = Path(pi_harness.PACKAGES_DIR)
    pins = f"{config.version}:{pi_harness.MCP_VERSION}:{pi_harness.ACP_VERSION}"
    versions = packages / ".versions"
    if versions.is_file() and versions.read_text() == pins:
        return
    pinned = subprocess.run(
        ["npm", "view", f"pi-acp@{pi_harness.ACP_VERSION}", "version"],
        capture_output=True,
        text=True,
        check=False,
    )
    if pinned.stdout.strip() == pi_harness.ACP_VERSION:
        return  # published: v1's own install fetches it
    specs = [f"@earendil-works/pi-coding-agent@{config.version}"]
    specs += [f"{name}@{version}" for name, version in PI_SUBSTITUTES.items()]
    subprocess.run(
        ["npm", "install", "--prefix", str(packages), "--ignore-scripts", "--no-audit"]
        + ["--no-fund", "--omit=dev", *specs],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PATH": f"{harness_node.NODE_DIR}/bin:{os.environ['PATH']}"},
    )
    versions.write_text(pins)


async def installed(name: str) -> list[str]:
    """The harness's install, once per machine; what each sandbox must see read-only."""
    if shutil.which("npm") is None:
        message = "SKIPPED: npm is needed to install the Node harnesses"
        if os.environ.get(REQUIRE_VAR) == "1":
            pytest.fail(message)
        pytest.skip(message)
    config, _ = HARNESSES[name]
    if isinstance(config, PiHarnessConfig):
        harness_node.provide_node()
        provide_pi(config)
    return await harness_node.install_on_host(config)


def agent_config(config: Any, base_url: str, read_only: list[str], **client: Any) -> Any:
    root = SANDBOX_ROOT
    runtime: Any = LocalSandboxRuntimeConfig(isolation="bwrap", root=str(root), read_only=read_only)
    return LocalSandboxAgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=base_url, **client),
        harness=config,
        runtime=runtime,
    )


#: User messages Claude Code adds after a tool result whose place depends on when the CLI
#: notices a file change, not on the endpoint: the note that a file it read changed on
#: disk, and the token budget left. Seen once in a few runs here: the note one turn later
#: through the gateway than through v1's own interception, the budget line in its place
#: (the model's turns, tool calls and token ids the same).
CLI_TIMED = re.compile(
    r"<total_tokens>\d+ tokens left</total_tokens>|Note: \S+ changed on disk since you last read it"
)


def messages_of(trace: vf.Trace) -> Any:
    """:func:`branch_messages`, with the trace's own id (in the harness's per-rollout
    config directory, which Claude Code's system prompt names) made the same and the
    :data:`CLI_TIMED` messages taken out (:func:`timed_notes` counts them)."""
    branches = json.loads(json.dumps(branch_messages(trace)).replace(trace.id, "TRACE"))
    return [[m for m in branch if not _cli_timed(m)] for branch in branches]


def timed_notes(trace: vf.Trace) -> list[str]:
    """The :data:`CLI_TIMED` messages of the trace's branches, sorted, numbers out."""
    notes = [m for b in branch_messages(trace) for m in b if _cli_timed(m)]
    return sorted(re.sub(r"\d+", "N", json.dumps(m)) for m in notes)


def _cli_timed(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return (
        message.get("role") == "user"
        and isinstance(content, str)
        and CLI_TIMED.match(content) is not None
    )


@pytest.mark.parametrize("name", list(HARNESSES))
async def test_the_harness_through_the_gateway_matches_v1s_own_interception(
    stack: Stack, make_interception: Any, name: str
) -> None:
    reason = unavailable_reasons()[IsolationMode.BWRAP]
    if reason is not None:
        pytest.skip(f"bwrap unavailable here: {reason}")
    read_only = await installed(name)
    config, shell = HARNESSES[name]
    own, through_gateway, served = await run_both_ways(
        stack,
        make_interception,
        lambda base_url, **client: agent_config(config, base_url, read_only, **client),
    )

    assert_same_run(own, through_gateway, served, shell)
    assert messages_of(through_gateway) == messages_of(own)
    assert timed_notes(through_gateway) == timed_notes(own)
