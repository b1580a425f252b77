"""The table of a local client's sandboxes: live ones, ones being destroyed, tombstones.

Owns destruction (kill every process, remove the directories, free the uid) and the
reaper thread that destroys sandboxes past their lifetime and stops those past a
resource limit (:mod:`~rollout_gateway.local_sandbox.limits`), so that
:class:`~rollout_gateway.local_sandbox.LocalSandboxClient` only maps prime-sandboxes'
API onto it. Thread-safe: the reaper, ``atexit`` and the event loop's worker threads all
reach it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NoReturn

from prime_sandboxes import APIError, SandboxNotRunningError, SandboxTimeoutError

from rollout_gateway.local_sandbox import layout, limits, processes, uids
from rollout_gateway.local_sandbox.sandbox import LocalSandbox

logger = logging.getLogger(__name__)

#: Ids of deleted or expired sandboxes remembered, so later calls fail like the real API's.
MAX_TOMBSTONES = 100_000


class SandboxRegistry:
    """Live sandboxes by id, and how the gone ones ended.

    Args:
        clock: monotonic clock the sandboxes' deadlines are on.
        kill_grace: seconds between SIGTERM and SIGKILL when destroying a sandbox.
    """

    def __init__(self, clock: Callable[[], float], kill_grace: float) -> None:
        self._clock = clock
        self._kill_grace = kill_grace
        self._lock = threading.RLock()
        self._live: dict[str, LocalSandbox] = {}
        self._destroying: dict[str, LocalSandbox] = {}
        self._gone: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, sb: LocalSandbox) -> None:
        """Track a new sandbox (before anything is created for it, so nothing can leak)."""
        with self._lock:
            self._live[sb.id] = sb

    def get(self, sandbox_id: str) -> LocalSandbox | None:
        """The live sandbox with this id, if any."""
        with self._lock:
            return self._live.get(sandbox_id)

    def known(self, sandbox_id: str) -> bool:
        """Whether this id is live or remembered as gone."""
        with self._lock:
            return sandbox_id in self._live or sandbox_id in self._gone

    def with_labels(self, labels: set[str]) -> list[str]:
        """Ids of the live sandboxes carrying every one of ``labels``."""
        with self._lock:
            return [sid for sid, sb in self._live.items() if labels.issubset(sb.request.labels)]

    def expired(self, sb: LocalSandbox) -> bool:
        """Whether ``sb`` is past its lifetime."""
        return self._clock() >= sb.deadline

    def raise_missing(self, sandbox_id: str, command: str | None = None) -> NoReturn:
        """Raise what prime-sandboxes raises for a sandbox that is not running."""
        with self._lock:
            gone = self._gone.get(sandbox_id)
        if gone is None:
            raise APIError(f"HTTP 404: Sandbox {sandbox_id} not found")
        status, error_type = gone
        if error_type == "TIMEOUT":
            raise SandboxTimeoutError(
                sandbox_id,
                status,
                error_type,
                command=command,
                message=f"Sandbox {sandbox_id} exceeded its timeout and was terminated",
            )
        raise SandboxNotRunningError(sandbox_id, status, error_type, command=command)

    def destroy(self, sb: LocalSandbox, status: str, error_type: str | None) -> None:
        """Kill all of the sandbox's processes, remove its directories, free its uid.

        Blocking (run it in a thread from async code); idempotent.
        """
        with self._lock:
            if self._live.pop(sb.id, None) is not None:
                self._gone[sb.id] = (status, error_type)
                while len(self._gone) > MAX_TOMBSTONES:
                    self._gone.popitem(last=False)
            self._destroying[sb.id] = sb
        with sb.lock:
            sb.dead = True  # no new process can start from here on
        # A create() cancelled mid-way (or a teardown meanwhile) leaves its worker thread
        # making the sandbox: wait for it, so that what it makes is removed below.
        sb.setup_lock.acquire()
        try:
            self._kill_everything(sb)
            if sb.lease is not None:
                sb.lease.release()  # kill -1 as the sandbox's uid, then free the uid
            if sb.cgroup is not None:
                sb.cgroup.remove()
            if sb.lock_fd is not None:  # closed first: it lives on the sandbox's disk
                fd, sb.lock_fd = sb.lock_fd, None
                os.close(fd)
            layout.remove_base(sb.dirs.base.parent, sb.dirs.base)
            if status == "TIMEOUT":
                logger.warning("Local sandbox %s exceeded its lifetime; killed", sb.id)
        finally:
            sb.setup_lock.release()
            with self._lock:
                self._destroying.pop(sb.id, None)

    def _kill_everything(self, sb: LocalSandbox) -> None:
        """SIGTERM the commands' process groups, SIGKILL what outlives the grace, then
        everything else of the sandbox (its cgroups, its sessions, its uid)."""
        with sb.lock:
            procs = list(sb.procs)
            leaders = set(sb.leaders)
        processes.kill_leaders(procs, self._kill_grace)  # type: ignore[arg-type]
        if sb.cgroup is not None:
            sb.cgroup.kill_all()
        # What is left in the commands' sessions: e.g. a namespace's init still being
        # set up (still root, not yet the sandbox's uid) when its launcher died.
        processes.kill_marked(sb.id, leaders)
        if sb.lease is not None:
            uids.kill_uid(sb.lease.uid)

    def stop_processes(self, sb: LocalSandbox) -> None:
        """Kill every process of a live sandbox; the sandbox stays (blocking)."""
        self._kill_everything(sb)

    def enforce_limits(self) -> list[str]:
        """Stop every live sandbox past a limit (kill all its processes, record why);
        their ids."""
        with self._lock:
            live = list(self._live.values())
        return [sb.id for sb in live if self.enforce_sandbox(sb)]

    def enforce_sandbox(self, sb: LocalSandbox, ended: object = None) -> bool:
        """Stop ``sb`` if it is past a limit (``ended``: a command that just ended, which
        the limit may have ended); whether it was stopped now.

        ``ended`` counts among the commands the stop ended also when the sandbox was
        stopped already: a command the limit ended (a fork refused, its shell gone) can
        exit just before the reaper thread stops the sandbox, and its caller must still
        be told why."""
        if sb.dead:
            return False
        why = None
        if sb.breach is None:
            try:
                why = limits.breach(
                    sb.limits, sb.cgroup, {}, sb.disk_image is not None, str(sb.dirs.base)
                )
            except OSError:
                return False  # being removed meanwhile
            if why is None:
                return False
        with sb.lock:  # one stop: the reaper thread and a command's end may both see it
            if ended is not None:
                sb.stopped_leaders.add(ended.pid)  # type: ignore[attr-defined]
            if sb.breach is not None or why is None:
                return False
            sb.stopped_leaders |= {p.pid for p in sb.procs if p.poll() is None}  # type: ignore[attr-defined]
            sb.breach = why
        logger.warning("Local sandbox %s stopped: %s", sb.id, why)
        self._kill_everything(sb)
        return True

    def destroy_all(self) -> None:
        """Destroy every sandbox, including those another thread is destroying.

        Safe from ``atexit`` and signal handlers (no event loop needed) and idempotent.
        """
        with self._lock:
            victims = list(self._live.values()) + list(self._destroying.values())
        for sb in victims:
            try:
                self.destroy(sb, "TERMINATED", None)
            except Exception:  # keep going: one failure must not leak the others
                logger.exception("Failed to delete local sandbox %s", sb.id)

    def reap_expired(self) -> list[str]:
        """Destroy every sandbox past its lifetime; return their ids."""
        now = self._clock()
        with self._lock:
            expired = [sb for sb in self._live.values() if now >= sb.deadline]
        for sb in expired:
            self.destroy(sb, "TIMEOUT", "TIMEOUT")
        return [sb.id for sb in expired]

    def start_reaper(self, interval: float) -> None:
        """Run :meth:`reap_expired` every ``interval`` s in a daemon thread (once)."""
        with self._lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            self._stop.clear()
            ref = weakref.ref(self)  # the thread must not keep the registry alive
            stop = self._stop

            def loop() -> None:
                while not stop.wait(interval):
                    registry = ref()
                    if registry is None:
                        return
                    try:
                        registry.reap_expired()
                        registry.enforce_limits()
                    except Exception:
                        logger.exception("Local sandbox reaper failed")
                    del registry

            self._reaper = threading.Thread(target=loop, name="local-sandbox-reaper", daemon=True)
            self._reaper.start()

    def stop_reaper(self) -> threading.Thread | None:
        """Tell the reaper thread to stop; the thread, to join, if one was running."""
        self._stop.set()
        reaper, self._reaper = self._reaper, None
        return reaper


__all__ = ["MAX_TOMBSTONES", "SandboxRegistry"]
