"""Which per-turn, env-side features of a v1 rollout a remote gateway cannot serve.

v1's interception server runs task hooks on every model call, inside the env process:
``@intercept`` rewrites, ``@stop`` hooks on requests, responses and the live trace,
tool-call gating, provider-capability mediation for restricted networks, and the
``/state`` channel of tool servers. The gateway serves the agent's calls without the env
on the path, so none of these can run; a task that declares any is refused before its
harness starts (or sent to v1's own interception when the user opts in), never run with
its hooks silently skipped.
"""

from __future__ import annotations

from typing import Any

from rollout_gateway.v1.internals import RolloutSession


def session_features(session: RolloutSession) -> list[str]:
    """The env-side per-turn features ``session`` needs, each named for the error message."""
    found: list[str] = []

    def names(hooks: list[Any]) -> str:
        return ", ".join(getattr(h, "__name__", repr(h)) for h in hooks)

    if session.request_interceptors:
        found.append(f"@intercept request rewrites ({names(session.request_interceptors)})")
    if session.response_interceptors:
        found.append(f"@intercept response rewrites ({names(session.response_interceptors)})")
    if session.request_stops:
        found.append(f"@stop hooks on requests ({names(session.request_stops)})")
    if session.response_stops:
        found.append(f"@stop hooks on responses ({names(session.response_stops)})")
    if session.trace_stops:
        found.append(f"@stop hooks on the live trace ({names(session.trace_stops)})")
    if session.network_policy.network_restricted:
        found.append("provider-capability mediation for a restricted network policy")
    return found


def toolset_features(toolsets: list[Any], shared_tools: dict[str, Any]) -> list[str]:
    """Tool servers that reach the rollout's ``/state`` channel (served by the env)."""
    found: list[str] = []
    if toolsets:
        found.append(
            "tool servers on the /state channel ("
            + ", ".join(type(t).__name__ for t in toolsets)
            + ")"
        )
    stateful = [name for name, tool in shared_tools.items() if getattr(tool, "state_secret", "")]
    if stateful:
        found.append(f"shared tool servers with state ({', '.join(sorted(stateful))})")
    return found


__all__ = ["session_features", "toolset_features"]
