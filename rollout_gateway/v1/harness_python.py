"""A Python for harness scripts that need a newer one than the host's.

A harness's PEP 723 script says which Python it needs (``requires-python``): verifiers
0.4.0's ``terminus_2`` runs Harbor 0.23.0, which needs Python >= 3.12. uv normally
downloads a Python that fits from GitHub (python-build-standalone); where GitHub is not
reachable, the ``local_sandbox`` runtime's per-machine harness cache installs the script
on an interpreter already on the host instead: the runtime's ``harness_python`` setting
(default ``$ROLLOUT_GATEWAY_HARNESS_PYTHON``), given to uv as ``--python``. Every sandbox
then sees that interpreter's installation read-only (:func:`python_prefix`), since the
script's environment runs on it.

:func:`find_python` finds one: a ``python3.X`` on ``PATH`` of at least the version asked
for, else one in pyenv's usual places (``$PYENV_ROOT/versions/*``, ``~/.pyenv/versions/*``),
which pyenv keeps off ``PATH`` unless selected.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

#: Overrides the default of ``LocalSandboxRuntimeConfig.harness_python``.
HARNESS_PYTHON_ENV_VAR = "ROLLOUT_GATEWAY_HARNESS_PYTHON"

_PROBE = "import sys; print(sys.version_info[0], sys.version_info[1]); print(sys.base_prefix)"


@functools.lru_cache(maxsize=32)
def _probe(python: str) -> tuple[tuple[int, int], Path] | None:
    """The version and installation prefix of the interpreter ``python`` (None when it
    does not run: a pyenv shim of a version not selected, a broken link)."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split("\n")
    if done.returncode != 0 or len(lines) < 2:
        return None
    major, minor = lines[0].split()
    return (int(major), int(minor)), Path(lines[1]).resolve()


def python_prefix(python: str) -> Path:
    """The installation (``sys.base_prefix``) the interpreter ``python`` runs from: what a
    sandbox must see to run a script environment built on it. Raises ``ValueError`` when
    it does not run."""
    probed = _probe(python)
    if probed is None:
        raise ValueError(f"harness_python {python!r} is not a Python interpreter that runs")
    return probed[1]


def _candidates(minimum: tuple[int, int]) -> list[str]:
    """Interpreters to try, best first: ``python3.X`` on ``PATH``, then pyenv's installed
    versions; each the oldest first (the closest to what the script asks for, the likeliest
    its pinned packages support)."""
    found: list[str] = []
    for minor in range(minimum[1], 21):
        program = shutil.which(f"python{minimum[0]}.{minor}")
        if program is not None:
            found.append(program)
    roots = [os.environ.get("PYENV_ROOT"), str(Path.home() / ".pyenv")]
    for root in dict.fromkeys(r for r in roots if r):
        versions = Path(root) / "versions"
        if versions.is_dir():
            for version in sorted(versions.iterdir(), key=_version_key):
                found.append(str(version / "bin" / "python3"))
    return found


def _version_key(path: Path) -> tuple[int, ...]:
    parts = [p for p in path.name.split(".") if p.isdigit()]
    return tuple(int(p) for p in parts)


def find_python(minimum: tuple[int, int] = (3, 12)) -> str | None:
    """A Python of at least ``minimum`` on this host (see the module doc for where it
    looks; the oldest that fits), or None."""
    for candidate in _candidates(minimum):
        probed = _probe(candidate)
        if probed is not None and probed[0] >= minimum:
            return candidate
    return None


__all__ = ["HARNESS_PYTHON_ENV_VAR", "find_python", "python_prefix"]
