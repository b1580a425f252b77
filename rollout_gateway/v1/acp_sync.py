"""Sync gateway turns into the trace when an ACP harness's prompt ends (claude_code,
codex, pi and v1's other ``ACPHarness`` subclasses), before v1 checks the turn.

An ACP harness replaces the harness segment by a live session
(``verifiers.v1.acp.ACPHarnessSession``): each prompt is a request to the ACP runner in
the runtime, and right after it answers, v1 requires the trace to hold a model call of
that prompt (``_require_model_turn``: "ACP agent completed without committing a model
turn"). Through v1's own interception the calls are in the trace by then; in gateway mode
they are at the gateway. So the session of a gateway-synced ACP harness is an instance of
a subclass of its own class whose prompt request marks a segment's start and syncs the
gateway's turns (and a limit's stop) once the runner answered, as
:func:`~rollout_gateway.v1.harness_sync.run_segment` does for a launched program.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_gateway.v1.internals import ACPHarness, ACPHarnessSession

if TYPE_CHECKING:
    from rollout_gateway.v1.harness_sync import SegmentHost


class GatewaySyncedACPSession(ACPHarnessSession):
    """Mixin: an ACP session whose prompts end with a gateway sync of its trace."""

    #: The rollout's interception (set on the instance by :func:`gateway_synced_session`).
    gateway_host: SegmentHost

    async def _request(self, operation: str, **payload: Any) -> Any:
        if operation != "prompt":
            return await super()._request(operation, **payload)
        self.gateway_host.segment_started(self.trace)
        response = await super()._request(operation, **payload)
        exit_code = 0 if response.get("ok") else 1
        await self.gateway_host.sync(self.trace, exit_code=exit_code)
        return response


#: The synced class of each ACP session class.
_CLASSES: dict[type, type] = {}


def gateway_synced_session(session: Any, host: SegmentHost) -> Any:
    """``session`` (an ``ACPHarnessSession``) with its prompts synced from the gateway;
    any other session as it is."""
    if not isinstance(session, ACPHarnessSession) or isinstance(session, GatewaySyncedACPSession):
        return session
    cls = type(session)
    synced = _CLASSES.get(cls)
    if synced is None:
        synced = type(f"GatewaySynced{cls.__name__}", (GatewaySyncedACPSession, cls), {})
        _CLASSES[cls] = synced
    # The session is v1's own object, built by the harness's own session(); only its
    # class gains the sync (a subclass with no state of its own).
    session.__class__ = synced
    session.gateway_host = host
    return session


def is_acp_harness(cls: type) -> bool:
    """Whether ``cls`` is one of v1's ACP harnesses (its session is a live ACP process)."""
    return issubclass(cls, ACPHarness)


__all__ = ["GatewaySyncedACPSession", "gateway_synced_session", "is_acp_harness"]
