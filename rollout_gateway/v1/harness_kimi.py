"""Kimi Code for verifiers 0.4's ``kimi_code`` harness, on a machine that cannot reach
code.kimi.com.

The harness installs Kimi Code with Moonshot's installer script
(``https://code.kimi.com/kimi-code/install.sh``) into ``/tmp/vf-kimi-code`` unless its
ready check passes: ``/tmp/vf-kimi-code/bin/kimi`` is executable and ``kimi --version``
prints the harness's pinned version. The same release is on the npm registry
(``@moonshot-ai/kimi-code``, a Node.js >= 22.19 program). :func:`provide_kimi_code` installs
it from there once per machine into the harness cache, with ``bin/kimi`` running it on
the Node.js of :func:`rollout_gateway.v1.harness_node.provide_node`, and returns what a
``local_sandbox`` runtime must show each sandbox read-only (:class:`KimiCodeInstall`):
the harness's ready check then passes in every sandbox and its installer never runs.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rollout_gateway.local_sandbox.harness_cache import HarnessCache, HarnessInstallError
from rollout_gateway.v1 import harness_node

#: Where the harness looks for Kimi Code (``verifiers.v1.harnesses.kimi_code``).
KIMI_DIR = "/tmp/vf-kimi-code"
#: The npm package of Kimi Code's releases.
NPM_PACKAGE = "@moonshot-ai/kimi-code"


@dataclass(frozen=True)
class KimiCodeInstall:
    """What each sandbox must see read-only: ``read_only`` (Node.js) and
    ``read_only_at`` (the install, at :data:`KIMI_DIR`), the runtime's settings."""

    read_only: list[str]
    read_only_at: dict[str, str]


def _launcher(version: str) -> str:
    """``bin/kimi``: the package's entry point on v1's Node.js, as seen in a sandbox."""
    main = f"{KIMI_DIR}/lib/node_modules/{NPM_PACKAGE}/dist/main.mjs"
    node = harness_node.NODE_DIR / "bin" / "node"
    return f'#!/bin/sh\n# Kimi Code {version} ({NPM_PACKAGE})\nexec {node} {main} "$@"\n'


def _fill(staging: Path, version: str, npm: str) -> None:
    """Install Kimi Code ``version`` from npm into ``staging`` (the cache's staging
    directory) and check its ``--version``."""
    done = subprocess.run(
        [npm, "install", "--prefix", str(staging / "lib"), "--ignore-scripts", "--no-audit"]
        + ["--no-fund", "--omit=dev", f"{NPM_PACKAGE}@{version}"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PATH": f"{harness_node.NODE_DIR}/bin:{os.environ.get('PATH', '')}"},
    )
    if done.returncode != 0:
        raise HarnessInstallError(f"npm install {NPM_PACKAGE}@{version}: {done.stderr[-2000:]}")
    (staging / "bin").mkdir()
    launcher = staging / "bin" / "kimi"
    launcher.write_text(_launcher(version))
    launcher.chmod(0o755)
    # v1's ensure_installed locks <directory>/install.lock: flock opens an existing file
    # on the read-only mount.
    (staging / "install.lock").touch()
    main = staging / "lib" / "node_modules" / NPM_PACKAGE / "dist" / "main.mjs"
    node = str(harness_node.NODE_DIR / "bin" / "node")
    shown = subprocess.run(
        [node, str(main), "--version"], capture_output=True, text=True, check=False, timeout=120
    )
    if shown.stdout.strip() != version:
        raise HarnessInstallError(
            f"{NPM_PACKAGE}@{version} says its version is {shown.stdout.strip()!r} "
            f"({shlex.join([node, str(main), '--version'])}: {shown.stderr[-500:]})"
        )


def provide_kimi_code(
    version: str, cache: HarnessCache | None = None, *, npm: str = "npm"
) -> KimiCodeInstall:
    """Kimi Code ``version`` (the harness's ``version``) from the npm registry, installed
    once per machine into ``cache`` (default: the per-machine harness cache), with the
    Node.js it runs on (:func:`~rollout_gateway.v1.harness_node.provide_node`); what the
    ``local_sandbox`` runtime must show each sandbox. Raises
    :class:`~rollout_gateway.local_sandbox.harness_cache.HarnessInstallError`."""
    harness_node.provide_node(npm=npm)
    cache = cache or HarnessCache()
    installed = cache.directory(f"kimi_code-{version}", lambda d: _fill(d, version, npm))
    return KimiCodeInstall(
        read_only=[str(harness_node.NODE_DIR)], read_only_at={KIMI_DIR: str(installed)}
    )


__all__ = ["KIMI_DIR", "NPM_PACKAGE", "KimiCodeInstall", "provide_kimi_code"]
