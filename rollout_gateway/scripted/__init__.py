"""A deterministic, scripted OpenAI-compatible model for demos, tests and benchmarks.

See :mod:`rollout_gateway.scripted.policy` for the ``<script>`` format and
:mod:`rollout_gateway.scripted.tokenizer` for the token ids it reports.
"""

from __future__ import annotations

from rollout_gateway.scripted.app import build_completion, create_scripted_model_app
from rollout_gateway.scripted.policy import DONE_TEXT, Action, ToolCall, decide, find_script

__all__ = [
    "DONE_TEXT",
    "Action",
    "ToolCall",
    "build_completion",
    "create_scripted_model_app",
    "decide",
    "find_script",
]
