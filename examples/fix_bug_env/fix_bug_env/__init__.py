"""fix-bug-env: a verifiers environment where a CLI agent fixes a bug in a tiny repo.

``load_environment`` and ``FixBugEnv`` live in :mod:`fix_bug_env.env` and are imported on
first use, so the tasks (:mod:`fix_bug_env.tasks`) and the agent program
(``fix_bug_env/agent.py``) are usable without importing verifiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fix_bug_env.env import FixBugEnv

__all__ = ["FixBugEnv", "load_environment"]


def load_environment(**kwargs: Any) -> FixBugEnv:
    """Build the environment; see :func:`fix_bug_env.env.load_environment`."""
    from fix_bug_env.env import load_environment as _load_environment

    return _load_environment(**kwargs)


def __getattr__(name: str) -> Any:
    if name == "FixBugEnv":
        from fix_bug_env.env import FixBugEnv

        return FixBugEnv
    raise AttributeError(f"module 'fix_bug_env' has no attribute {name!r}")
