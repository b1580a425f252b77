"""Whether the gateway can do its work: can it reach its upstreams and its state store.

A :class:`HealthMonitor` probes them on its own timer (``interval_s``), never per
``/health`` request: a load balancer checking every 500 ms, or a hundred agents asking,
cost the engine nothing more. Each probe is bounded (``timeout_s``):

* an upstream: ``GET {base}/models`` (what the engine probe reads); unreachable, timed out
  or a 5xx answer is *down*, with that reason, and gets no new rollouts until a probe
  finds it answering (a turn that could not connect already kept new rollouts away:
  :meth:`~.engines.upstream.Upstream.connection_failure`; ``/health`` says so from the
  next probe, a second later at most).
* the state store: :meth:`~.state.store.RolloutStore.check` (Redis: a read; SQLite: a
  write of one row, so a full disk shows; memory: nothing can fail).

The gateway is *healthy* (``/health`` answers 200) when its store answers and at least
one upstream does; otherwise ``/health`` answers 503, which takes it out of a load
balancer's rotation (HAProxy ``option httpchk``), and says why. With some upstreams down
and one up it is *degraded*: 200, the reasons listed, new rollouts pinned to those up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_gateway.server.engines.upstream import Upstream

logger = logging.getLogger("rollout_gateway.server")

Status = Literal["ok", "degraded", "unhealthy"]


@dataclass
class Dependency:
    """One thing the gateway needs (an upstream, the store) as the last probe found it."""

    #: What it is, safe for anyone (``upstream 1``, ``state store``).
    name: str
    #: Where it is, for the admin only (an upstream's URL without credentials).
    where: str
    #: ``None`` until first probed.
    up: bool | None = None
    #: Why it is down (the admin's detail: the error as the client raised it).
    reason: str = ""
    #: Monotonic time its state last changed, and of its last probe.
    since: float = field(default_factory=time.monotonic)
    checked_at: float | None = None
    #: Failed probes in a row.
    failures: int = 0

    def answered(self, now: float) -> bool:
        """A probe succeeded; whether that changed the state."""
        changed = self.up is not True
        self.up, self.reason, self.failures = True, "", 0
        self._checked(now, changed)
        return changed

    def failed(self, now: float, reason: str) -> bool:
        """A probe failed with ``reason``; whether that changed the state."""
        changed = self.up is not False
        self.up, self.reason = False, reason
        self.failures += 1
        self._checked(now, changed)
        return changed

    def _checked(self, now: float, changed: bool) -> None:
        self.checked_at = now
        if changed:
            self.since = now

    def describe(self, now: float, *, admin: bool) -> dict[str, Any]:
        """For ``/health``: up, for how long, and why not (the detail for the admin)."""
        out: dict[str, Any] = {"name": self.name, "up": self.up}
        out["for_s"] = round(now - self.since, 3)
        if self.checked_at is not None:
            out["checked_s_ago"] = round(now - self.checked_at, 3)
        if admin:
            out["where"] = self.where
        if self.up is False:
            out["reason"] = self.reason if admin else "unreachable"
            out["failed_probes"] = self.failures
        return out


def _failure_text(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within the probe's timeout"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass(frozen=True)
class HealthReport:
    """What ``/health`` answers: the status and the reasons, for anyone; each dependency's
    state for the admin."""

    status: Status
    #: One line per dependency down (the admin's lines name where it is and the error).
    reasons: tuple[str, ...]
    #: :meth:`Dependency.describe` of the store, then of each upstream.
    dependencies: tuple[dict[str, Any], ...]

    @property
    def healthy(self) -> bool:
        """Whether the gateway can serve turns (``/health`` answers 200)."""
        return self.status != "unhealthy"


class HealthMonitor:
    """Probes the upstreams and the store every ``interval_s`` (see the module doc).

    Args:
        upstreams: the gateway's upstreams (their HTTP clients, and the ``healthy`` mark
            new rollouts are pinned by).
        check_store: raises when the store cannot be used now.
        store_name: the store's backend, for messages.
        interval_s: period of the probes.
        timeout_s: bound of each probe.
        clock: monotonic clock (tests).
    """

    def __init__(
        self,
        upstreams: Sequence[Upstream],
        check_store: Callable[[], Awaitable[object]],
        store_name: str,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstreams = list(upstreams)
        self.check_store = check_store
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.upstream_states = [
            Dependency(f"upstream {i + 1}", u.label, since=clock())
            for i, u in enumerate(self.upstreams)
        ]
        self.store_state = Dependency("state store", store_name, since=clock())

    async def probe(self) -> None:
        """Probe every upstream and the store now, concurrently (each bounded)."""
        await asyncio.gather(
            self._probe_store(),
            *(
                self._probe_upstream(u, d)
                for u, d in zip(self.upstreams, self.upstream_states, strict=True)
            ),
        )

    async def run(self) -> None:
        """Probe every ``interval_s`` until cancelled (the app's lifespan runs it)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe()
            except Exception:  # a probe's own bug must not end the probing
                logger.exception("health probe failed")

    async def _probe_upstream(self, upstream: Upstream, state: Dependency) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await upstream.http.get("/models", timeout_s=self.timeout_s)
        except Exception as exc:
            upstream.healthy = False  # no new rollouts pinned there until it answers
            self._down(state, f"unreachable: {_failure_text(exc)}")
            return
        if answer.status_code >= 500:
            upstream.healthy = False
            self._down(state, f"GET /models answered HTTP {answer.status_code}")
            return
        upstream.answered()
        if state.answered(self.clock()):
            logger.info("health: %s (%s) answers again", state.name, state.where)

    async def _probe_store(self) -> None:
        state = self.store_state
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.check_store()
        except Exception as exc:
            self._down(state, _failure_text(exc))
            return
        if state.answered(self.clock()):
            logger.info("health: the %s state store answers again", state.where)

    def _down(self, state: Dependency, reason: str) -> None:
        if state.failed(self.clock(), reason):
            logger.warning("health: %s (%s) is down: %s", state.name, state.where, reason)

    def report(self, *, admin: bool) -> HealthReport:
        """The state as the last probes found it."""
        down = [s for s in self.upstream_states if s.up is False]
        status: Status = "ok"
        if self.store_state.up is False or (
            self.upstream_states and len(down) == len(self.upstream_states)
        ):
            status = "unhealthy"
        elif down:
            status = "degraded"
        states = (self.store_state, *self.upstream_states)
        reasons = tuple(
            (f"{s.name} ({s.where}): {s.reason}" if admin else f"{s.name} unreachable")
            for s in states
            if s.up is False
        )
        now = self.clock()
        return HealthReport(status, reasons, tuple(s.describe(now, admin=admin) for s in states))

    def up_values(self) -> dict[tuple[str, ...], float]:
        """For ``/metrics``: 1 per dependency up (or not probed yet), 0 down, by (kind,
        where): ``("upstream", url)``, ``("store", backend)``."""
        out: dict[tuple[str, ...], float] = {
            ("upstream", s.where): float(s.up is not False) for s in self.upstream_states
        }
        out["store", self.store_state.where] = float(self.store_state.up is not False)
        return out

    def unreachable_at_start(self) -> list[str]:
        """The start-up warning's lines: each dependency the first probe found down."""
        return [
            f"{s.name} {s.where} does not answer ({s.reason})"
            for s in (*self.upstream_states, self.store_state)
            if s.up is False
        ]


__all__ = ["Dependency", "HealthMonitor", "HealthReport", "Status"]
