"""Sync gateway turns into the trace before v1 judges how the harness exited.

v1's ``HarnessSession.turn`` runs the harness program, then ``Harness._check_result``:
a non-zero exit is clean only if ``trace.stop_condition`` is already set (a refused turn
ends the program with the 4xx it got). v1's own server sets that stop *before* it answers
the refused call; in gateway mode the refusal happens at the gateway, so without a sync
the rollout would come back ``ok=False, stop="harness_error"`` and unscored.

The hook chosen: a subclass of the loaded harness class whose ``_check_result`` first
awaits :meth:`GatewayInterception.sync`. Why this one:

- it is the one place v1 reads ``stop_condition`` to judge an exit, so the sync happens
  exactly when needed, after the program exited (no race with turns still in flight, as a
  live event stream across a tunnel would have);
- it covers every harness that runs through v1's default session, built-in or custom,
  and every segment of a multi-segment interaction (``Rollout.step`` then counts the new
  turns);
- it is a *subclass*, not a wrapper: v1 rebuilds a harness as ``type(harness)(config)``
  when a task adds skills, and the rebuilt one keeps the hook;
- no verifiers code is patched: the harness object of each agent is replaced.

Harnesses that replace the session entirely (ACP) never call ``_check_result``; for them
the final sync at slot release still rebuilds the trace before scoring. That release sync
is skipped only when the last segment's exit was synced and no segment started since
(``launch``/``resume`` mark a segment's start), so a trajectory is fetched once per
segment in the common case.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_gateway.v1.internals import Harness, ProgramResult, Runtime, Trace

if TYPE_CHECKING:
    from rollout_gateway.v1.interception import GatewayInterception
    from rollout_gateway.v1.internals import Agent

_CLASSES: dict[tuple[type, int], type] = {}


class GatewaySyncedHarness(Harness):
    """Mixin: ``_check_result`` syncs the gateway's turns into the trace first."""

    gateway_interception: GatewayInterception

    async def _check_result(self, trace: Trace, runtime: Runtime, result: ProgramResult) -> None:
        await self.gateway_interception.sync(trace, exit_code=result.exit_code)
        await super()._check_result(trace, runtime, result)

    # Each segment starts with launch (v1's default resume relaunches through it): the
    # trace is then behind the gateway until the segment's exit is synced (a segment cut
    # by a timeout never is). A class with its own resume gets the same mark there. The
    # segment runs under the rollout's refusal watch: a turn the gateway refuses ends it
    # at once, whatever the program does with the refusal (see :mod:`.refusals`).
    async def launch(self, ctx: Any, trace: Trace, *args: Any, **kwargs: Any) -> ProgramResult:
        interception = self.gateway_interception
        interception.segment_started(trace)
        async with interception.refusal_watch(trace) as watch:
            return await super().launch(ctx, trace, *args, **kwargs)
        return watch.result()  # only when the refusal ended the segment


async def _marked_resume(
    self: GatewaySyncedHarness, ctx: Any, trace: Trace, *args: Any, **kwargs: Any
) -> ProgramResult:
    interception = self.gateway_interception
    interception.segment_started(trace)
    async with interception.refusal_watch(trace) as watch:
        return await super(GatewaySyncedHarness, self).resume(ctx, trace, *args, **kwargs)
    return watch.result()


def gateway_synced(harness: Harness, interception: GatewayInterception) -> Harness:
    """``harness`` as an instance of its class with the gateway sync hook (idempotent)."""
    if isinstance(harness, GatewaySyncedHarness):
        return harness
    cls = type(harness)
    key = (cls, id(interception))
    synced = _CLASSES.get(key)
    if synced is None:
        namespace: dict[str, Any] = {
            "gateway_interception": interception,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        }
        if cls.resume is not Harness.resume:
            # Only then: v1 reads "overrides resume" as native resume support.
            namespace["resume"] = _marked_resume
        synced = type(f"GatewaySynced{cls.__name__}", (GatewaySyncedHarness, cls), namespace)
        _CLASSES[key] = synced
    return synced(harness.config)


def gateway_synced_agent(agent: Agent, interception: GatewayInterception) -> Agent:
    """Give ``agent`` the gateway sync hook (for ``vf.Agent(..., interception=gi)``)."""
    agent.harness = gateway_synced(agent.harness, interception)
    return agent


def forget(interception: GatewayInterception) -> None:
    """Drop the classes made for ``interception`` (called when it stops)."""
    for key in [k for k in _CLASSES if k[1] == id(interception)]:
        del _CLASSES[key]


__all__ = ["GatewaySyncedHarness", "forget", "gateway_synced", "gateway_synced_agent"]
