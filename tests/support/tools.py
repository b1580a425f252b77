"""The example agent's tool as tests and benchmarks send it to real engines."""

from __future__ import annotations

import json
from typing import Any

#: The example agent's one tool, ``run_shell(command)``, as an OpenAI tool definition (for
#: conversations sent to real engines by tests and benchmarks).
RUN_SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def run_shell_call(call_id: str, command: str) -> dict[str, Any]:
    """An assistant message calling :data:`RUN_SHELL_TOOL` with ``command``."""
    function = {"name": "run_shell", "arguments": json.dumps({"command": command})}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


__all__ = ["RUN_SHELL_TOOL", "run_shell_call"]
