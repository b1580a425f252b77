"""A v1 harness's setup on the ``local_sandbox`` runtime: the first rollout on a machine
(the harness's install into the per-machine cache) against every later one (the cache
read-only in a fresh sandbox).

One "setup" is what a rollout pays before its agent starts: ``runtime.start()`` (a new
contained sandbox) plus the harness's own ``setup(runtime)`` (v1's ``bash``,
``mini_swe_agent``, ``terminus_2``: ``prepare_uv_script``), then the sandbox is stopped.
The first setup runs against an empty cache (a fresh directory unless ``--cache``), so it
includes uv downloading and installing the harness's packages from PyPI; the later ones
are fresh sandboxes on the same machine.

The Node harnesses (``claude_code``, ``codex``) install once per machine on the host
(:func:`rollout_gateway.v1.harness_node.install_on_host`: Node.js from npm, the CLI and
its ACP adapter with npm, v1's ACP runner with uv), which is their "first" figure; every
later sandbox sees that install read-only (``read_only``) and the harness's own
``setup()`` finds it ready; ``kimi_code`` likewise, its release from npm
(:func:`rollout_gateway.v1.harness_kimi.provide_kimi_code`) seen where its ready check
looks (``read_only_at``). They need ``npm`` and the package registries. ``terminus_2``
needs a Python >= 3.12 on the host (:func:`rollout_gateway.v1.harness_python.find_python`,
the runtime's ``harness_python``). Prints, per harness, the first setup and the median /
max of the later ones (seconds). Target: later setups under 2 s.

    .ci-venv-v1/bin/python benchmarks/harness_setup.py [--later 5] [--harness bash ...]
        [--cache DIR] [--isolation bwrap]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: The harnesses measured (v1's, imported when measured: ``--help`` works on any stack).
HARNESSES = ("bash", "mini_swe_agent", "terminus_2", "claude_code", "codex", "kimi_code")
#: Those installed on the host once and seen read-only by every sandbox.
NODE_HARNESSES = ("claude_code", "codex")
#: What v1's ACP runner's uv needs to reach PyPI from a sandbox, forwarded explicitly.
FORWARD = ["SSL_CERT_FILE"]


def harness_named(name: str) -> Any:
    """v1's harness ``name``, made from its default config."""
    from verifiers.v1.harnesses import (
        BashHarness,
        BashHarnessConfig,
        MiniSWEAgentHarness,
        MiniSWEAgentHarnessConfig,
        Terminus2Harness,
        Terminus2HarnessConfig,
    )

    if name == "bash":
        return BashHarness(BashHarnessConfig())
    if name == "mini_swe_agent":
        return MiniSWEAgentHarness(MiniSWEAgentHarnessConfig(id="mini_swe_agent"))
    if name in NODE_HARNESSES:
        from rollout_gateway.v1.internals import load_harness

        return load_harness(node_harness_config(name))
    if name == "kimi_code":
        from verifiers.v1.harnesses.kimi_code import KimiCodeHarness, KimiCodeHarnessConfig

        return KimiCodeHarness(KimiCodeHarnessConfig(id="kimi_code"))
    return Terminus2Harness(Terminus2HarnessConfig(id="terminus_2"))


def node_harness_config(name: str) -> Any:
    """The config of v1's Node harness ``name`` (its default CLI version)."""
    from verifiers.v1.harnesses.claude_code import ClaudeCodeHarnessConfig
    from verifiers.v1.harnesses.codex import CodexHarnessConfig

    if name == "claude_code":
        return ClaudeCodeHarnessConfig(id="claude_code", forward_env=FORWARD)
    return CodexHarnessConfig(id="codex", forward_env=FORWARD)


async def one_setup(harness: Any, config: Any) -> float:
    """Seconds from a new sandbox to the harness ready in it (the sandbox then stopped)."""
    from rollout_gateway.v1.runtime import LocalSandboxRuntime

    runtime = LocalSandboxRuntime(config)
    started = time.perf_counter()
    try:
        await runtime.start()
        await harness.setup(runtime)
        return time.perf_counter() - started
    finally:
        await runtime.stop()


async def first_node_setup(name: str, config: Any) -> tuple[float, Any]:
    """The Node harness's install on the host (seconds) and ``config`` with the install
    read-only in every sandbox."""
    from rollout_gateway.v1.harness_node import install_on_host

    started = time.perf_counter()
    paths = await install_on_host(node_harness_config(name))
    took = time.perf_counter() - started
    return took, config.model_copy(update={"read_only": [*config.read_only, *paths]})


def first_kimi_setup(harness: Any, config: Any) -> tuple[float, Any]:
    """Kimi Code's install from npm into the cache (seconds) and ``config`` with it
    where the harness's ready check looks, in every sandbox."""
    from rollout_gateway.local_sandbox.harness_cache import HarnessCache
    from rollout_gateway.v1.harness_kimi import provide_kimi_code

    started = time.perf_counter()
    install = provide_kimi_code(harness.config.version, HarnessCache(config.harness_cache_root))
    took = time.perf_counter() - started
    update = {
        "read_only": [*config.read_only, *install.read_only],
        "read_only_at": {**config.read_only_at, **install.read_only_at},
    }
    return took, config.model_copy(update=update)


def with_python(config: Any) -> Any:
    """``config`` with a host Python >= 3.12 as ``harness_python`` (Harbor's need)."""
    from rollout_gateway.v1.harness_python import find_python

    python = config.harness_python or find_python((3, 12))
    if python is None:
        raise RuntimeError("no Python >= 3.12 on this host (PATH, pyenv): harness_python")
    return config.model_copy(update={"harness_python": python})


async def measure(name: str, config: Any, later: int) -> str:
    """One harness's first setup and the median / max of ``later`` ones, as a line."""
    harness = harness_named(name)
    try:
        if name in NODE_HARNESSES:
            first, config = await first_node_setup(name, config)
        elif name == "kimi_code":
            first, config = await asyncio.to_thread(first_kimi_setup, harness, config)
        else:
            if name == "terminus_2":
                config = with_python(config)
            first = await one_setup(harness, config)
    except Exception as e:  # noqa: BLE001 - reported, the next harness still runs
        lines = str(e).strip().splitlines() or [type(e).__name__]
        return f"{name:<16} setup failed: {lines[0][:160]} ... {lines[-1].strip()[:160]}"
    times = [await one_setup(harness, config) for _ in range(later)]
    return (
        f"{name:<16} first {first:7.2f} s   later median {statistics.median(times):6.3f} s"
        f"   max {max(times):6.3f} s   ({later} rollouts; first/later "
        f"{first / statistics.median(times):.0f}x)"
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--later", type=int, default=5, help="later rollouts per harness")
    parser.add_argument("--harness", action="append", choices=list(HARNESSES))
    parser.add_argument("--cache", help="harness cache to use (default: a fresh, empty one)")
    parser.add_argument("--isolation", default="bwrap")
    args = parser.parse_args()
    from rollout_gateway.v1 import LocalSandboxRuntimeConfig

    top = Path(tempfile.mkdtemp(prefix="rg-harness-setup-", dir="/tmp"))
    top.chmod(0o755)
    try:
        config = LocalSandboxRuntimeConfig(
            isolation=args.isolation,
            root=str(top / "sandboxes"),
            harness_cache_root=args.cache or str(top / "cache"),
        )
        print(f"isolation {args.isolation}, cache {config.harness_cache_root}")
        for name in args.harness or HARNESSES:
            print(await measure(name, config, args.later), flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
