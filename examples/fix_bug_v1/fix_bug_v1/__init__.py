"""fix-bug-v1: a verifiers v1 taskset, harness and env for rollout-gateway's gateway mode."""

from fix_bug_v1.env import FixBugEnv
from fix_bug_v1.harness import FixBugHarness, FixBugHarnessConfig
from fix_bug_v1.tasks import FixBugTask, FixBugTaskset

__all__ = ["FixBugEnv", "FixBugHarness", "FixBugHarnessConfig", "FixBugTask", "FixBugTaskset"]
