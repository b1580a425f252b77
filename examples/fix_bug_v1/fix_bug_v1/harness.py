"""The harness (re-exported from :mod:`rollout_gateway.examples.fix_bug_v1`)."""

from rollout_gateway.examples.fix_bug_v1.harness import (
    FixBugHarness,
    FixBugHarnessConfig,
    run_program,
)

__all__ = ["FixBugHarness", "FixBugHarnessConfig", "run_program"]
