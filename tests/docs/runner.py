"""Run a session of doc blocks: one bash process in a scratch copy of the checkout.

What a block sees (docs/contributing-docs.md says the same to authors):

* the working directory holds links to the checkout's top-level entries (so ``-e .``
  and ``./examples/...`` resolve); whatever the blocks write stays there;
* the README's virtualenvs (``.venv``, ``.venv-classic``) that a session uses but does
  not create stand for the suite's virtualenv (``. .venv/bin/activate`` works);
* ``PATH`` starts with a shim directory, then the suite's virtualenv: ``python``,
  ``python3`` and ``python3.11`` are the suite's interpreter, except that
  ``python3.11 -m venv DIR`` makes ``DIR`` stand for the suite's virtualenv, and ``pip
  install ...`` checks that what it names is installed there (``pip_check.py``) instead
  of installing it;
* the declared ports are replaced by free ones; no ``ROLLOUT_GATEWAY_*`` or ``OPENAI_*``
  variable of the test process leaks in;
* everything the session starts is stopped at its end (its process group).

With ``DOCS_SNIPPETS_REAL_INSTALL=1`` there are no shims: installs run for real (into
the virtualenvs the blocks create, or the suite's own). ``fresh_venv.sh`` runs the
README that way, in fresh virtualenvs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from snippets import ROOT, Block, Session
from support.local_cluster import free_port

from rollout_gateway import child_processes

#: Top-level entries of the checkout not linked into the scratch directory.
_NOT_LINKED = {".git", "outputs", "site"}
_NOT_LINKED_PREFIXES = (".venv", ".ci-venv")
_HERE = Path(__file__).resolve().parent


@dataclass
class SessionResult:
    returncode: int | None  # None: timed out
    output: str

    def output_of(self, block: Block) -> str:
        """What ``block`` printed (stdout and stderr, up to the next block's start)."""
        _, found, rest = self.output.partition(f"{BLOCK_START}{block.where}\n")
        return rest.partition(BLOCK_START)[0] if found else ""


#: The line announcing each block in a session's output.
BLOCK_START = "### doc block "


def _write_exec(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def make_shims(shim_dir: Path) -> None:
    """The shim directory: the suite's interpreter under the names blocks use, ``pip``
    as the install checker, and ``python3.11 -m venv`` as a stand-in virtualenv."""
    shim_dir.mkdir()
    py = sys.executable
    venv_bin = Path(py).parent
    checker = _HERE / "pip_check.py"
    _write_exec(shim_dir / "pip", f'#!/bin/sh\nexec "{py}" "{checker}" "$@"\n')
    make_venv = textwrap.dedent(
        f"""\
        #!/bin/sh
        # python3.11 -m venv DIR: DIR stands for the suite's virtualenv.
        if [ "$1" = "-m" ] && [ "$2" = "venv" ] && [ -n "$3" ]; then
            dir="$3"
            mkdir -p "$dir/bin"
            for exe in "{venv_bin}"/*; do
                name=$(basename "$exe")
                case "$name" in
                    pip|pip3|pip3.*|activate*|Activate*) continue ;;
                esac
                printf '#!/bin/sh\\nexec "%s" "$@"\\n' "$exe" > "$dir/bin/$name"
                chmod 755 "$dir/bin/$name"
            done
            cp "{shim_dir}/pip" "$dir/bin/pip"
            # ". DIR/bin/activate" puts DIR/bin first on PATH, as a virtualenv's does.
            dir=$(cd "$dir" && pwd)
            cat > "$dir/bin/activate" <<ACTIVATE
        VIRTUAL_ENV="$dir"
        export VIRTUAL_ENV
        PATH="$dir/bin:\\$PATH"
        export PATH
        hash -r 2>/dev/null || true
        ACTIVATE
            exit 0
        fi
        exec "{py}" "$@"
        """
    )
    for name in ("python", "python3", "python3.11"):
        _write_exec(shim_dir / name, make_venv)


def make_workdir(workdir: Path) -> None:
    """A scratch directory with links to the checkout's top-level entries."""
    workdir.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in _NOT_LINKED or entry.name.startswith(_NOT_LINKED_PREFIXES):
            continue
        (workdir / entry.name).symlink_to(entry)


#: The virtualenvs the README's two commands create (``.venv``: v1, ``.venv-classic``).
README_VENVS = (".venv", ".venv-classic")


def make_readme_venvs(shim_dir: Path, workdir: Path, blocks: list[Block]) -> None:
    """Stand-ins (the suite's virtualenv) for the README's virtualenvs a session uses but
    does not create, as after a newcomer ran the two commands: ``. .venv/bin/activate``
    then works as written."""
    code = "\n".join(block.code for block in blocks)
    for name in README_VENVS:
        if name in code and f"-m venv {name}" not in code:
            subprocess.run(
                [str(shim_dir / "python3.11"), "-m", "venv", name], cwd=workdir, check=True
            )


def _with_ports(code: str, ports: dict[int, int]) -> str:
    for shown, real in ports.items():
        code = re.sub(rf"(?<!\d){shown}(?!\d)", str(real), code)
    return code


def session_script(session: Session, blocks: list[Block], workdir: Path) -> str:
    """The bash script of a session: each block in order, announced on stderr."""
    ports = {p: free_port() for p in session.ports}
    parts = ["set -e -o pipefail"]
    for i, block in enumerate(blocks):
        code = _with_ports(block.code, ports)
        parts.append(f"echo '{BLOCK_START}{block.where}' >&2")
        if block.language == "python":
            script = workdir / f".doc-block-{i}.py"
            script.write_text(code)
            parts.append(f"python {script.name}")
        else:
            parts.append(code)
    parts.append("echo '### doc session done' >&2")
    return "\n".join(parts) + "\n"


#: Set to 1: installs in blocks run for real (no shims).
REAL_INSTALL_ENV = "DOCS_SNIPPETS_REAL_INSTALL"


def real_install() -> bool:
    return os.environ.get(REAL_INSTALL_ENV) == "1"


def _clean_environment(shim_dir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ROLLOUT_GATEWAY_", "OPENAI_", "PYTEST_", "VIRTUAL_ENV"))
    }
    venv_bin = str(Path(sys.executable).parent)
    first = [venv_bin] if real_install() else [str(shim_dir), venv_bin]
    env["PATH"] = os.pathsep.join([*first, env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_session(session: Session, blocks: list[Block], tmp: Path) -> SessionResult:
    """Run ``blocks`` of ``session`` in a fresh scratch directory under ``tmp``."""
    shim_dir, workdir = tmp / "shims", tmp / "work"
    make_shims(shim_dir)
    make_workdir(workdir)
    make_readme_venvs(shim_dir, workdir, blocks)
    script = workdir / ".doc-session.sh"
    script.write_text(session_script(session, blocks, workdir))
    log = tmp / "output.log"
    with log.open("wb") as out:
        # Its own process group: everything the blocks start (servers with &) is
        # stopped with it, and nothing else; the whole group dies with this process,
        # even by kill -9.
        proc = child_processes.spawn(
            ["bash", script.name],
            cwd=workdir,
            env=_clean_environment(shim_dir),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            whole_group=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=session.timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _stop_group(proc)
    return SessionResult(returncode, log.read_text(errors="replace"))


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the session's process group: SIGTERM, then SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            continue
        break
    if proc.poll() is None:
        proc.wait()
