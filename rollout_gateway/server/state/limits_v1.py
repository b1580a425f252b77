"""verifiers v1's per-rollout limits, enforced by the gateway with v1's own counting.

v1's interception checks ``RolloutLimits`` before every model call and, when one is
reached, refuses the call and makes the limit the rollout's stop condition. In gateway
mode the env is not on the path, so the gateway does it: the register body may carry
``max_input_tokens``, ``max_output_tokens`` and ``max_total_tokens``
(:data:`rollout_gateway.protocol.TOKEN_LIMIT_FIELDS`; ``max_turns`` is the protocol's
own), and the trajectory answer reports the limit that refused a turn as
``"stop_condition"``. Counting follows ``verifiers.v1.trace``: a turn's *new* input is
its prompt beyond the previous turn's prompt + completion (never negative), output is
the completion, total is both; the caps are soft by one turn (checked between turns).
Checks run in v1's order: turns, input, output, total.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_gateway.protocol import TOKEN_LIMIT_FIELDS


@dataclass
class TokenBudget:
    """One rollout's v1 token caps and what its turns used so far."""

    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_total_tokens: int | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    #: The previous turn's prompt + completion tokens (a turn's new input is beyond it).
    previous_total: int = 0

    @classmethod
    def from_limits(cls, body: Mapping[str, Any]) -> TokenBudget | None:
        """The caps a register body (checked: :func:`~rollout_gateway.protocol.
        parse_register_request`) asks for, or ``None`` when it sets none."""
        caps = {name: body[name] for name in TOKEN_LIMIT_FIELDS if body.get(name) is not None}
        return cls(**caps) if caps else None

    @property
    def total_tokens(self) -> int:
        """New input plus output, as v1's ``Trace.num_total_tokens``."""
        return self.input_tokens + self.output_tokens

    def reached(self) -> str | None:
        """The first token cap reached, by v1's name, or ``None``."""
        if self.max_input_tokens is not None and self.input_tokens >= self.max_input_tokens:
            return "max_input_tokens"
        if self.max_output_tokens is not None and self.output_tokens >= self.max_output_tokens:
            return "max_output_tokens"
        if self.max_total_tokens is not None and self.total_tokens >= self.max_total_tokens:
            return "max_total_tokens"
        return None

    def add_turn(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one served turn (``prompt_tokens`` including cache reads)."""
        self.input_tokens += max(0, prompt_tokens - self.previous_total)
        self.output_tokens += completion_tokens
        self.previous_total = prompt_tokens + completion_tokens


def turn_token_counts(
    completion: Mapping[str, Any],
    prompt_tokens: int | None,
    completion_ids: list[int] | None,
) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of an upstream answer: usage, else the ids."""
    usage = completion.get("usage")
    if isinstance(usage, Mapping):
        prompt, comp = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(comp, int):
            return prompt, comp
    return prompt_tokens or 0, len(completion_ids or ())


__all__ = ["TokenBudget", "turn_token_counts"]
