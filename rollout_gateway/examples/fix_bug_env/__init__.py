"""fix_bug_env: a verifiers environment where a CLI agent fixes a bug in a tiny repository.

Shipped inside rollout-gateway so that an installed wheel runs ``rollout-gateway demo``
and ``vf-eval rollout_gateway.examples.fix_bug_env`` with nothing else installed. Library
modules never import it; only the demo does.

``load_environment`` and ``FixBugEnv`` live in :mod:`.env` and are imported on first use,
so the tasks (:mod:`.tasks`) and the agent program (``agent.py`` next to this module) are
usable without importing verifiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_gateway.examples.fix_bug_env.env import FixBugEnv

__all__ = ["FixBugEnv", "load_environment"]


def load_environment(**kwargs: Any) -> FixBugEnv:
    """Build the environment; see :func:`.env.load_environment`."""
    from rollout_gateway.examples.fix_bug_env.env import load_environment as _load_environment

    return _load_environment(**kwargs)


def __getattr__(name: str) -> Any:
    if name == "FixBugEnv":
        from rollout_gateway.examples.fix_bug_env.env import FixBugEnv

        return FixBugEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
