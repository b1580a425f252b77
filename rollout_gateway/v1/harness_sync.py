"""Sync gateway turns into the trace when a harness segment ends, before v1 judges its exit.

v1 judges a harness segment's exit right after ``launch`` (or ``resume``) returns: a
non-zero exit is clean only if ``trace.stop_condition`` is already set (a refused turn ends
the program with the 4xx it got). v1's own server sets that stop before it answers the
refused call; in gateway mode the refusal happens at the gateway, so without a sync the
rollout would come back ``ok=False, stop="harness_error"``, unscored.

So each agent's harness becomes an instance of a subclass of its own class (v1 rebuilds a
harness as ``type(harness)(config)``, which keeps it) whose ``launch`` (and ``resume``,
where the class has its own) runs the segment through :func:`run_segment`: mark its start,
end it at once if the gateway refuses one of its turns (:mod:`.refusals`), and sync the
gateway's turns and stop once the program exited (no race with turns in flight). Nothing
of v1 is patched, and only the harness contract's own methods are overridden. An ACP
harness's session never launches: its prompts sync instead (:mod:`.acp_sync`). docs/v1.md
says more; the interception is known here by :class:`SegmentHost` only.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from rollout_gateway.v1.acp_sync import gateway_synced_session, is_acp_harness
from rollout_gateway.v1.internals import Harness, ProgramResult, Trace
from rollout_gateway.v1.refusals import RefusalWatch

if TYPE_CHECKING:
    from rollout_gateway.v1.internals import Agent


class SegmentHost(Protocol):
    """What a harness segment needs of its rollout's interception
    (:class:`~rollout_gateway.v1.GatewayInterception` is one)."""

    def segment_started(self, trace: Trace) -> None:
        """A segment of ``trace`` starts: turns may come that no sync has seen."""
        ...

    def refusal_watch(self, trace: Trace) -> RefusalWatch:
        """The watch that ends the segment when the gateway refuses a turn of ``trace``."""
        ...

    async def sync(self, trace: Trace, *, exit_code: int | None = None) -> None:
        """Commit the gateway's turns of ``trace``, and its limit stop after ``exit_code``."""
        ...


#: Whether this task runs inside a segment already: a harness's own ``resume`` may relaunch
#: through ``launch`` (v1's default does), which is the same segment, synced once.
_IN_SEGMENT: ContextVar[bool] = ContextVar("rollout_gateway_v1_in_segment", default=False)


async def run_segment(
    host: SegmentHost, trace: Trace, program: Awaitable[ProgramResult]
) -> ProgramResult:
    """Run one harness segment of ``trace`` (``program``: the harness's own ``launch`` or
    ``resume``) under the rollout's refusal watch; once the program exited, sync the
    gateway's turns into the trace. A segment the refusal ended returns what a killed
    program returns (:meth:`RefusalWatch.result`)."""
    if _IN_SEGMENT.get():
        return await program
    token = _IN_SEGMENT.set(True)
    try:
        host.segment_started(trace)
        async with host.refusal_watch(trace) as watch:
            result = await program
        if watch.fired:
            result = watch.result()
    finally:
        _IN_SEGMENT.reset(token)
    await host.sync(trace, exit_code=result.exit_code)
    return result


class GatewaySyncedHarness(Harness):
    """Mixin: each harness segment runs through :func:`run_segment`."""

    #: The interception, weakly: a harness class lives as long as the classes v1 keeps.
    _gateway_ref: weakref.ref[SegmentHost]

    @property
    def gateway_interception(self) -> SegmentHost:
        """The interception whose rollouts this harness class syncs."""
        host = self._gateway_ref()
        if host is None:
            raise RuntimeError("this harness's gateway interception is closed")
        return host

    async def launch(self, ctx: Any, trace: Trace, *args: Any, **kwargs: Any) -> ProgramResult:
        program = super().launch(ctx, trace, *args, **kwargs)
        return await run_segment(self.gateway_interception, trace, program)


async def _synced_resume(
    self: GatewaySyncedHarness, ctx: Any, trace: Trace, *args: Any, **kwargs: Any
) -> ProgramResult:
    program = super(GatewaySyncedHarness, self).resume(ctx, trace, *args, **kwargs)
    return await run_segment(self.gateway_interception, trace, program)


async def _synced_session(self: GatewaySyncedHarness, *args: Any, **kwargs: Any) -> Any:
    session = await super(GatewaySyncedHarness, self).session(*args, **kwargs)
    return gateway_synced_session(session, self.gateway_interception)


#: The synced class of each harness class, per interception (gone with the interception).
_CLASSES: weakref.WeakKeyDictionary[SegmentHost, dict[type, type]] = weakref.WeakKeyDictionary()


def gateway_synced(harness: Harness, interception: SegmentHost) -> Harness:
    """``harness`` as an instance of its class with the gateway segment hook (idempotent)."""
    if isinstance(harness, GatewaySyncedHarness):
        return harness
    cls = type(harness)
    classes = _CLASSES.setdefault(interception, {})
    synced = classes.get(cls)
    if synced is None:
        namespace: dict[str, Any] = {
            "_gateway_ref": weakref.ref(interception),
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        }
        if cls.resume is not Harness.resume:
            # Only then: v1 reads "overrides resume" as native resume support.
            namespace["resume"] = _synced_resume
        if is_acp_harness(cls):
            # An ACP session never launches: its prompts sync instead (:mod:`.acp_sync`).
            namespace["session"] = _synced_session
        synced = type(f"GatewaySynced{cls.__name__}", (GatewaySyncedHarness, cls), namespace)
        classes[cls] = synced
    return synced(harness.config)


def gateway_synced_agent(agent: Agent, interception: SegmentHost) -> Agent:
    """Give ``agent`` the gateway segment hook (for ``vf.Agent(..., interception=gi)``)."""
    agent.harness = gateway_synced(agent.harness, interception)
    return agent


__all__ = [
    "GatewaySyncedHarness",
    "SegmentHost",
    "gateway_synced",
    "gateway_synced_agent",
    "run_segment",
]
