"""A client's warden: removes its sandboxes when the client's process dies untidily.

A process killed with ``kill -9`` (or crashing) runs no teardown: in the ``bwrap`` mode
its sandboxes' processes die with it (``--die-with-parent``), in the other modes they
live on, with the sandboxes' directories, file systems and cgroups, until another
client's stale sweep (:func:`~rollout_gateway.local_sandbox.layout.sweep_stale`) runs.
The warden makes that sweep happen at once: a tiny process in a session of its own
(``/bin/sh`` blocked on reading a pipe whose only writer is the client) that, when the
pipe ends without the client's ``done`` line, runs the stale sweep on the client's root
(twice, a second apart: the dead client's locks are released as its files close). The
sweep removes only sandboxes whose owning client is gone, never a live client's.

A client that tears down says ``done`` first (the warden exits and sweeps nothing).
The pipe's write end is not inherited by the processes the client starts (Python's
pipes are close-on-exec), so an agent cannot keep the warden waiting.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

#: Blocks on the pipe; on EOF without "done" starts Python to sweep (``$0``: the
#: interpreter, ``$1``: where this package is, appended to ``sys.path`` so the client's
#: own copy is found wherever it came from, ``$2``: the root). ``read`` waits for free.
_SWEEP = (
    "import sys; sys.path.append(sys.argv[1]); "
    "from rollout_gateway.local_sandbox.warden import main; sys.exit(main(sys.argv[2:]))"
)
_WATCH = f'read -r said; [ "$said" = done ] || exec "$0" -c \'{_SWEEP}\' "$1" "$2"'


class Warden:
    """The warden of one client's sandbox root (see the module doc); started on first
    use (:meth:`ensure`), stood down by :meth:`stand_down`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The warden's process id while it watches (``None``: not started)."""
        return self._proc.pid if self._proc is not None else None

    def ensure(self) -> None:
        """Start watching, unless watching already."""
        if self._proc is not None and self._proc.poll() is None:
            return
        package_parent = str(Path(__file__).resolve().parents[2])
        self._proc = subprocess.Popen(
            ["/bin/sh", "-c", _WATCH, sys.executable, package_parent, str(self.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,  # not in the client's group: a kill of it spares this
        )

    def stand_down(self) -> None:
        """The client tidied up: tell the warden, which exits without sweeping."""
        proc, self._proc = self._proc, None
        if proc is None or proc.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write(b"done\n")
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)


def main(argv: list[str]) -> int:
    """The sweep the warden runs once its client is gone."""
    from rollout_gateway.local_sandbox import layout

    (root,) = argv
    removed = layout.sweep_stale(Path(root))
    time.sleep(1.0)  # a lock the dying client still held is released by now
    removed += layout.sweep_stale(Path(root))
    if removed:
        logger.warning("warden: removed %d sandbox(es) of a dead client", len(removed))
    return 0


__all__ = ["Warden"]
