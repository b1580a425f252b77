"""The parts of verifiers v1's eval CLI that the demo's eval runner uses (demo only).

``rollout-gateway demo`` on the v1 stack runs an eval as ``vf-eval`` does
(:mod:`rollout_gateway.v1.demo`): the resolved config and its files, env loading,
planning, resume, the trace store. Those live in v1's CLI modules, which move more
than the runtime's (:data:`rollout_gateway.v1.internals.PRIVATE`, scope ``eval``), so
they are imported here, apart from :mod:`.internals`: a moved CLI module fails the demo
with :class:`~rollout_gateway.v1.internals.UnsupportedVerifiersError` naming it, and
leaves the runtime adapter (the interception, the env, the runtime) importable.
"""

from __future__ import annotations

from rollout_gateway.v1.internals import VERIFIERS_VERSION, UnsupportedVerifiersError

try:
    from verifiers.v1.cli.eval import resume as eval_resume
    from verifiers.v1.cli.output import create_attempt_log_dir, write_config
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.cli.eval import EvalConfig
    from verifiers.v1.episode import EvalRunInfo
    from verifiers.v1.utils.eval import plan_rollouts
    from verifiers.v1.utils.loaders import load_environment
    from verifiers.v1.utils.trace_store import type_adapter
except ImportError as e:  # an internal moved: say which verifiers, not just which name
    raise UnsupportedVerifiersError(VERIFIERS_VERSION, f"{type(e).__name__}: {e}") from e

__all__ = [
    "EvalConfig",
    "EvalRunInfo",
    "ModelContext",
    "create_attempt_log_dir",
    "eval_resume",
    "load_environment",
    "plan_rollouts",
    "type_adapter",
    "write_config",
]
