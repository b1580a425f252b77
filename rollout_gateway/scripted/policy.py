"""The scripted model's policy: follow a ``<script>JSON</script>`` block in the prompt.

The first ``<script>...</script>`` block found in a system or user message (in message
order) holds a JSON list of steps. The step played is the one whose index equals the
number of assistant messages already in the request. A step is one of:

* ``{"tool": NAME, "arguments": {...}}``: one tool call (``finish_reason`` ``"tool_calls"``);
* ``{"say": TEXT}``: assistant text (``finish_reason`` ``"stop"``);
* ``{"one_of": [step, ...]}``: one of the alternatives; the first when the temperature is
  0 or absent, else chosen by ``random.Random(seed)`` (``seed`` of the request) or by an
  unseeded RNG when the request has no seed.

Past the end of the script, or without a script, the model says ``"Done."``.

A ``run_shell`` step drives whichever shell tool the agent offers: when the request's
tools have no ``run_shell`` but one of :data:`SHELL_TOOLS` (Claude Code's ``Bash``, Codex's
``exec_command``), the call goes to that tool with the step's ``command`` in that tool's
own argument, so one script runs the example agent, Claude Code and Codex alike.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway.scripted.tokenizer import message_text

_SCRIPT_RE = re.compile(r"<script>(.*?)</script>", re.DOTALL)

#: What the model says past the end of its script.
DONE_TEXT = "Done."


@dataclass(frozen=True)
class ToolCall:
    """One tool call the policy decided to make."""

    id: str
    name: str
    arguments: str  # JSON-encoded, as in the OpenAI API


@dataclass(frozen=True)
class Action:
    """What the model answers for one request (before any ``max_tokens`` cut)."""

    text: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """``"tool_calls"`` when the action calls a tool, else ``"stop"``."""
        return "tool_calls" if self.tool_calls else "stop"


def find_script(messages: Sequence[Mapping[str, Any]]) -> list[Any] | None:
    """The first valid script in a system or user message, or ``None``."""
    for message in messages:
        if message.get("role") not in ("system", "user"):
            continue
        for match in _SCRIPT_RE.finditer(message_text(message)):
            try:
                steps = json.loads(match.group(1))
            except ValueError:
                continue
            if isinstance(steps, list):
                return steps
    return None


#: The script's shell tool, as the example agent names it.
SCRIPT_SHELL_TOOL = "run_shell"
#: Shell tools of real agents: the name, and the argument that holds the command.
SHELL_TOOLS: dict[str, str] = {
    "run_shell": "command",  # the example agent
    "Bash": "command",  # Claude Code
    "exec_command": "cmd",  # Codex
    "shell": "command",  # Codex's older shell tool, ...
    "bash": "command",  # pi
}


def tool_names(tools: Sequence[Any] | None) -> list[str]:
    """The names of a chat request's ``tools`` (function and custom tools)."""
    names = []
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        spec = tool.get("function") or tool.get("custom") or tool
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if isinstance(name, str):
            names.append(name)
    return names


def shell_call(arguments: Any, offered: Sequence[str]) -> tuple[str, Any] | None:
    """A ``run_shell`` step's call on the agent's own shell tool (``None``: the agent
    offers ``run_shell`` itself, or no shell tool this model knows)."""
    if SCRIPT_SHELL_TOOL in offered or not isinstance(arguments, Mapping):
        return None
    for name in offered:
        argument = SHELL_TOOLS.get(name)
        if argument is not None:
            return name, {argument: arguments.get("command", "")}
    return None


def _resolve(step: Any, temperature: float, rng: random.Random | None) -> Any:
    """Resolve nested ``one_of`` choices down to a concrete step."""
    while isinstance(step, Mapping) and "one_of" in step:
        options = step["one_of"]
        if not isinstance(options, list) or not options:
            return None
        if temperature > 0:
            step = (rng or random.Random()).choice(options)
        else:
            step = options[0]
    return step


def decide(
    messages: Sequence[Mapping[str, Any]],
    *,
    temperature: float | None = None,
    seed: int | None = None,
    tools: Sequence[Any] | None = None,
) -> Action:
    """The action of the scripted model for a request with these messages (and the
    ``tools`` the request offers: see :data:`SHELL_TOOLS`)."""
    script = find_script(messages)
    index = sum(1 for m in messages if m.get("role") == "assistant")
    if script is None or index >= len(script):
        return Action(text=DONE_TEXT)
    temp = float(temperature or 0.0)
    rng = random.Random(seed) if (temp > 0 and seed is not None) else None
    step = _resolve(script[index], temp, rng)
    if isinstance(step, Mapping) and "tool" in step:
        name, arguments = str(step["tool"]), step.get("arguments", {})
        if name == SCRIPT_SHELL_TOOL:
            name, arguments = shell_call(arguments, tool_names(tools)) or (name, arguments)
        encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return Action(tool_calls=[ToolCall(f"call_{index}_0", name, encoded)])
    if isinstance(step, Mapping) and "say" in step:
        return Action(text=str(step["say"]))
    return Action(text=DONE_TEXT)


__all__ = [
    "DONE_TEXT",
    "SCRIPT_SHELL_TOOL",
    "SHELL_TOOLS",
    "Action",
    "ToolCall",
    "decide",
    "find_script",
    "shell_call",
    "tool_names",
]
