"""A virtualenv holding what ``pip install rollout-gateway`` installs: the core, no extra.

Built offline from this test environment's own files: the core's requirements and
theirs (each distribution's top-level modules and its metadata, linked into one
directory on the new virtualenv's path) and this checkout's ``rollout_gateway``. Neither
verifiers nor prime-sandboxes nor openai is importable there, and package metadata
says they are not installed, as after a core-only install.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def _core_closure() -> list[metadata.Distribution]:
    """The distributions the core requires, and theirs (no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    pending = [
        Requirement(text)
        for text in metadata.requires("rollout-gateway") or []
        if "extra ==" not in text
    ]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        dist = metadata.distribution(requirement.name)
        seen[name] = dist
        pending += [Requirement(text) for text in dist.requires or []]
    return list(seen.values())


def _top_level(dist: metadata.Distribution) -> set[str]:
    """The top-level files and directories a distribution installed (and its dist-info)."""
    names = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        if len(file.parts) == 1 and not first.endswith((".py", ".so", ".pyd")):
            continue
        names.add(first)
    return names


def core_only_python(tmp: Path) -> Path:
    """A fresh virtualenv under ``tmp`` with the core install; returns its python."""
    site = tmp / "core-site"
    site.mkdir()
    for dist in _core_closure():
        root = Path(str(dist.locate_file("")))
        for name in _top_level(dist):
            if not (site / name).exists() and (root / name).exists():
                (site / name).symlink_to(root / name)
    (site / "rollout_gateway").symlink_to(REPO / "rollout_gateway")
    info = site / "rollout_gateway-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rollout-gateway\nVersion: 0.0.0\n")
    venv = tmp / "core-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True,
    ).strip()
    (Path(purelib) / "core.pth").write_text(f"{site}\n")
    return python
