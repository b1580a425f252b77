"""Node.js and the installs of verifiers 0.4's Node harnesses (``claude_code``, ``codex``,
``pi``) on a machine that cannot reach nodejs.org.

Those harnesses run their CLI through an ACP adapter under Node.js >= 22.19, which v1's
``ensure_node`` downloads from nodejs.org into ``/var/tmp/vf-node`` unless a Node.js of
its pinned version is already there. :func:`provide_node` puts the same build there from
the npm registry (npm's ``node-linux-<arch>`` package of v1's pinned version: Node's own
release binary), which ``ensure_node`` then accepts as installed.

:func:`install_on_host` runs a harness's own ``setup()`` (v1's install step: Node, the
CLI and its adapter with npm, the ACP runner with uv) once on this machine, on v1's
subprocess runtime; :func:`install_paths` names what it installed, for a
``local_sandbox`` runtime's ``read_only`` setting: each contained sandbox then sees the
install read-only at the same path, and the harness's ``setup()`` in the rollout finds it
ready instead of installing again.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from rollout_gateway.v1.internals import (
    SubprocessConfig,
    SubprocessRuntime,
    load_harness,
    node_harness_modules,
    v1_node,
)

#: Where v1's ``ensure_node`` looks for Node.js, and the version it accepts there.
NODE_DIR = Path(v1_node.NODE_DIR)
NODE_VERSION = v1_node.NODE_VERSION
#: ``ensure_node``'s lock, beside ``NODE_DIR`` (its install replaces the directory).
NODE_LOCK = Path(f"{v1_node.NODE_DIR}.install.lock")

_NPM_ARCH = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def node_package() -> str:
    """The npm package holding Node's release binary for this machine, at v1's version."""
    machine = platform.machine().lower()
    arch = _NPM_ARCH.get(machine)
    if arch is None or platform.system() != "Linux":
        raise RuntimeError(f"no npm build of Node.js for {platform.system()} {machine}")
    return f"node-linux-{arch}@{NODE_VERSION}"


def node_ready(directory: Path = NODE_DIR) -> bool:
    """Whether ``directory`` holds the Node.js v1's ``ensure_node`` accepts (its check:
    ``bin/node --version`` is v1's pinned version)."""
    node = directory / "bin" / "node"
    if not node.is_file():
        return False
    done = subprocess.run([str(node), "--version"], capture_output=True, text=True, check=False)
    return done.returncode == 0 and done.stdout.strip() == f"v{NODE_VERSION}"


def provide_node(directory: Path = NODE_DIR, *, npm: str = "npm") -> Path:
    """Put Node.js (v1's pinned version, from the npm registry) where ``ensure_node``
    accepts it, unless it is there; its ``node`` program. Staged beside the directory and
    renamed into place, so an interrupted download never looks installed."""
    node = directory / "bin" / "node"
    if node_ready(directory):
        return node
    if shutil.which(npm) is None:
        raise RuntimeError(f"npm is needed to provide Node.js {NODE_VERSION} ({node_package()})")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        packed = subprocess.run(
            [npm, "pack", "--silent", "--pack-destination", str(staging), node_package()],
            check=True,
            capture_output=True,
            text=True,
        )
        tarball = staging / packed.stdout.strip().splitlines()[-1]
        with tarfile.open(tarball) as archive:
            member = archive.getmember("package/bin/node")
            source = archive.extractfile(member)
            assert source is not None
            (staging / "bin").mkdir()
            with (staging / "bin" / "node").open("wb") as out:
                shutil.copyfileobj(source, out)
        tarball.unlink()
        (staging / "bin" / "node").chmod(0o755)
        staging.chmod(0o755)
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not node_ready(directory):
        raise RuntimeError(f"{node_package()} did not provide Node.js v{NODE_VERSION} at {node}")
    return node


def install_dir(config: Any) -> Path:
    """Where the harness of ``config`` (claude_code, codex or pi) installs its CLI."""
    claude_code, codex, pi = node_harness_modules()

    if isinstance(config, claude_code.ClaudeCodeHarnessConfig):
        dirs = claude_code.CLAUDE_ACP_DIR.format(
            version=config.version, acp_version=claude_code.ACP_VERSION
        )
    elif isinstance(config, codex.CodexHarnessConfig):
        dirs = codex.CODEX_DIR.format(version=config.version, acp_version=codex.ACP_VERSION)
    elif isinstance(config, pi.PiHarnessConfig):
        dirs = pi.PI_DIR
    else:
        raise ValueError(
            f"{type(config).__name__} is not the config of one of v1's Node harnesses "
            "(claude_code, codex, pi)"
        )
    return Path(dirs)


def install_paths(config: Any) -> list[str]:
    """What the harness of ``config`` installs, for ``LocalSandboxRuntimeConfig.read_only``:
    Node.js, ``ensure_node``'s lock file, the harness's own directory."""
    return [str(NODE_DIR), str(NODE_LOCK), str(install_dir(config))]


async def install_on_host(config: Any) -> list[str]:
    """Run the harness's own ``setup()`` once on this machine (v1's subprocess runtime),
    after :func:`provide_node`; :func:`install_paths`. Its ready checks make a second
    call cheap (a few seconds: v1's runner script is re-checked with uv)."""
    provide_node()
    runtime = SubprocessRuntime(SubprocessConfig())
    await runtime.start()
    try:
        await load_harness(config).setup(runtime)
    finally:
        await runtime.stop()
    return install_paths(config)


__all__ = [
    "NODE_DIR",
    "NODE_LOCK",
    "NODE_VERSION",
    "install_dir",
    "install_on_host",
    "install_paths",
    "node_package",
    "node_ready",
    "provide_node",
]
