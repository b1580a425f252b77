"""Packaging: a core without verifiers or openai, and two mutually exclusive stack extras."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

#: The modules of the core: what a gateway host or another adapter imports.
CORE_MODULES = [
    "rollout_gateway",
    "rollout_gateway.protocol",
    "rollout_gateway.client",
    "rollout_gateway.errors",
    "rollout_gateway.tunnels",
    "rollout_gateway.settings",
    "rollout_gateway.resources",
    "rollout_gateway.lifecycle",
    "rollout_gateway.agent_wait",
    "rollout_gateway.interrupt",
    "rollout_gateway.exits",
    "rollout_gateway.launch",
    "rollout_gateway.polling",
    "rollout_gateway.server",
    "rollout_gateway.scripted",
    "rollout_gateway.testing",
    "rollout_gateway.cli",
]

_SERVER = PYPROJECT.parent / "rollout_gateway" / "server"
#: Every module of the gateway server (a gateway host imports any of them), but the
#: renderer plug-in of the [tito] extra, which is made of ``renderers``.
SERVER_MODULES = sorted(
    ".".join(("rollout_gateway", "server", *path.relative_to(_SERVER).with_suffix("").parts))
    for path in _SERVER.rglob("*.py")
    if path.name not in ("__init__.py", "template_bridge.py")
)

_BLOCKED_IMPORT = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("verifiers", "openai", "renderers", "transformers"):
                raise ImportError(f"core imported {name}")
            return None

    sys.meta_path.insert(0, Block())
    for module in sys.argv[1:]:
        importlib.import_module(module)
    roots = ("verifiers", "openai", "renderers", "transformers")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in roots)
    assert not loaded, loaded
    print("ok")
    """
)


def test_core_modules_import_without_verifiers_or_openai() -> None:
    # A fresh interpreter where importing verifiers or openai (or the [tito] extra's
    # renderers / transformers) fails: the core must not try.
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, *CORE_MODULES, *SERVER_MODULES],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def _requirements(names: list[str]) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name: r for line in names}


def test_base_dependencies_name_no_verifiers_stack() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    base = _requirements(project["dependencies"])
    assert not {"verifiers", "openai", "prime-sandboxes"} & set(base)


def test_stack_extras_cannot_be_installed_together() -> None:
    # pip refuses `rollout-gateway[classic,v1]`: no verifiers version satisfies both pins.
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    classic = _requirements(extras["classic"])["verifiers"].specifier
    v1 = _requirements(extras["v1"])["verifiers"].specifier
    candidates = [f"0.{minor}.{patch}" for minor in range(2, 7) for patch in range(0, 12)]
    assert not [v for v in candidates if classic.contains(v) and v1.contains(v)]
    assert any(classic.contains(v) for v in candidates)
    assert any(v1.contains(v) for v in candidates)
