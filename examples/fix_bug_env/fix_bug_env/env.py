"""Alias of :mod:`rollout_gateway.examples.fix_bug_env.env` (one module, not a copy)."""

import sys

from rollout_gateway.examples.fix_bug_env import env as _module

sys.modules[__name__] = _module
