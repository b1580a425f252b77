"""Alias of :mod:`rollout_gateway.examples.fix_bug_env.tasks` (one module, not a copy)."""

import sys

from rollout_gateway.examples.fix_bug_env import tasks as _module

sys.modules[__name__] = _module
