"""Compatibility alias of :mod:`rollout_gateway.examples.fix_bug_env`, so that the env id
``fix-bug-env`` (``vf-eval fix-bug-env``) and ``import fix_bug_env`` keep working."""

from __future__ import annotations

from typing import Any

from rollout_gateway.examples.fix_bug_env import load_environment

__all__ = ["FixBugEnv", "load_environment"]


def __getattr__(name: str) -> Any:
    import rollout_gateway.examples.fix_bug_env as real

    return getattr(real, name)
