"""What harnesses install, installed once per machine and shared read-only by every sandbox.

A harness (verifiers v1's ``bash``, ``mini_swe_agent``, ``claude_code``, ...) installs
its program before each rollout: a PEP 723 script's environment (``prepare_uv_script``),
or a directory such as ``/var/tmp/vf-claude-code`` behind a ready check
(``ensure_installed``). In a fresh sandbox per rollout that install would run every
time (11-15 s for mini-swe-agent), and need a ``uv`` and the host's certificates inside
the sandbox. Instead the install runs once per machine, on the host, into this cache;
every sandbox sees the cache read-only, so the agent can run what was installed but
never change it (nor see anything else of the host).

Layout under the root (:func:`cache_root`: ``$ROLLOUT_GATEWAY_HARNESS_CACHE``, default
``~/.cache/rollout-gateway/harnesses``), every entry world-readable (``a+rX``) so a
sandbox's own uid can run it:

- ``uv/<sha256 of the recipe and script>/script.py``: a PEP 723 script, its environment
  made by ``uv sync --script`` with bytecode compiled (a sandbox cannot write
  ``__pycache__`` there); uv's cache and any Python uv fetches stay under ``uv-cache/``
  and ``uv-python/`` of the root. :meth:`HarnessCache.uv_script` returns the script's
  path and its environment's interpreter: what ``prepare_uv_script`` hands back.
- ``dirs/<name>/``: any other harness's install (:meth:`HarnessCache.directory`),
  made by a callable that fills a staging directory; a sandbox sees it read-only at
  the path the harness expects (the runtime's ``read_only_at``, e.g.
  ``{"/var/tmp/vf-claude-code": "<root>/dirs/claude_code"}``) so the harness's own
  ready check passes and its install is skipped. A harness whose install lock lives
  inside its directory (v1's ``ensure_installed``: ``<directory>/install.lock``) finds
  it there when ``fill`` leaves that file in place (``flock`` opens an existing file
  on a read-only mount); a lock beside the directory (``/var/tmp/vf-node.install.lock``)
  goes to the sandbox's own writable ``/var/tmp``.

Each entry is made at most once per machine: under an exclusive file lock (concurrent
rollouts and processes wait for the first), into a staging directory renamed into
place when complete, so an interrupted install never looks installed. Installs run on
the host as the env's user with the host's environment (proxy, ``SSL_CERT_FILE``):
they install the harness's program, chosen by the env author, never the agent's
commands; none of that environment reaches a sandbox.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rollout_gateway.agent_clis import readable_by_all

#: Overrides the cache directory of :func:`cache_root`.
CACHE_ENV_VAR = "ROLLOUT_GATEWAY_HARNESS_CACHE"


#: How a script is installed, part of its cache key: a change here reinstalls.
#: Bytecode is compiled at install: a sandbox cannot write ``__pycache__`` into the
#: read-only cache, so without it every rollout would recompile every module it imports
#: (litellm: over a minute per rollout on two cores).
_UV_RECIPE = b"uv sync --script --compile-bytecode\n"


class HarnessInstallError(RuntimeError):
    """A harness's install into the per-machine cache failed (its output's tail says why)."""


def cache_root() -> Path:
    """Where harness installs live: ``$ROLLOUT_GATEWAY_HARNESS_CACHE``, else
    ``~/.cache/rollout-gateway/harnesses``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "rollout-gateway" / "harnesses"


@dataclass(frozen=True)
class UvProgram:
    """A PEP 723 script installed in the cache: its path and its environment's Python."""

    script: Path
    interpreter: Path


class HarnessCache:
    """The per-machine cache of harness installs under ``root`` (see the module doc)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else cache_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(self.root.stat().st_mode | 0o555)
        self._uv_programs: dict[str, UvProgram] = {}

    @contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        locks = self.root / "locks"
        locks.mkdir(exist_ok=True)
        with open(locks / f"{name}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def directory(self, name: str, fill: Callable[[Path], None]) -> Path:
        """``dirs/<name>``, made once by ``fill(staging)`` (blocking; raises what
        ``fill`` raises, leaving nothing behind)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"harness cache: bad directory name {name!r}")
        final = self.root / "dirs" / name
        if final.is_dir():
            return final
        with self._locked(f"dir-{name}"):
            if final.is_dir():
                return final
            final.parent.mkdir(parents=True, exist_ok=True)
            final.parent.chmod(final.parent.stat().st_mode | 0o555)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
            try:
                fill(staging)
                readable_by_all(staging)
                staging.rename(final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return final

    def uv_script(self, source: bytes, python: str | None = None) -> UvProgram:
        """The PEP 723 script ``source`` with its environment, installed once per machine
        (blocking: the first call runs ``uv sync --script``). ``python``: the interpreter
        uv builds the environment on (``--python``; part of the cache key), for a script
        whose ``requires-python`` the host's own Python does not meet; None: uv's
        choice."""
        recipe = _UV_RECIPE if python is None else _UV_RECIPE + f"--python {python}\n".encode()
        digest = hashlib.sha256(recipe + source).hexdigest()
        known = self._uv_programs.get(digest)
        if known is not None:
            return known
        final = self.root / "uv" / digest
        with self._locked(f"uv-{digest}"):
            program = self._installed(final)
            if program is None:
                self._install_uv_script(final, source, python)
                program = self._installed(final)
                if program is None:
                    raise HarnessInstallError(f"uv installed {final} without its interpreter")
        self._uv_programs[digest] = program
        return program

    @staticmethod
    def _installed(final: Path) -> UvProgram | None:
        marker = final / "interpreter"
        if not marker.is_file():
            return None
        interpreter = Path(marker.read_text().strip())
        if not interpreter.exists():
            return None
        return UvProgram(final / "script.py", interpreter)

    def _uv_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "UV_CACHE_DIR": str(self.root / "uv-cache"),
            "UV_PYTHON_INSTALL_DIR": str(self.root / "uv-python"),
            "UV_NO_CONFIG": "1",
            "UV_OFFLINE": "false",
            "UV_COMPILE_BYTECODE": "1",
        }

    def _install_uv_script(self, final: Path, source: bytes, python: str | None) -> None:
        # The script keeps its final path: uv keys the script's environment by it.
        final.mkdir(parents=True, exist_ok=True)
        script = final / "script.py"
        script.write_bytes(source)
        uv = _uv_program()
        env = self._uv_env()
        if python is not None:
            # Both commands must pick the same interpreter (find names the environment).
            env["UV_PYTHON"] = python
        for argv in (
            [uv, "sync", "--script", str(script), "-q"],
            [uv, "python", "find", "--script", str(script)],
        ):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                detail = (done.stderr.strip() or done.stdout.strip())[-2000:]
                raise HarnessInstallError(f"{' '.join(argv[1:3])} {script}: {detail}")
        interpreter = done.stdout.strip().splitlines()[-1]
        # The environment (and a Python uv fetched), and the directories leading to it.
        environment = Path(interpreter).parent.parent
        for made in (environment, self.root / "uv-python", final):
            if made.exists() and self.root in made.parents:
                readable_by_all(made)
                for parent in made.parents:
                    if parent == self.root:
                        break
                    parent.chmod(parent.stat().st_mode | 0o555)
        # Written last: its presence means the install completed.
        (final / "interpreter").write_text(interpreter + "\n")
        (final / "interpreter").chmod(0o644)


def _uv_program() -> str:
    """The ``uv`` program: the ``uv`` package's (PyPI), else one on ``PATH``."""
    try:
        import uv

        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise HarnessInstallError(
                "installing a harness's uv script needs uv: pip install uv"
            ) from None
        return found


__all__ = [
    "CACHE_ENV_VAR",
    "HarnessCache",
    "HarnessInstallError",
    "UvProgram",
    "cache_root",
    "readable_by_all",
]
