"""The gateway's limits under verifiers 0.3's stop-condition names.

verifiers 0.3's ``MultiTurnEnv`` ends a rollout with a stop named after the check that
fired (``max_turns_reached``, ``prompt_too_long``, ``max_total_completion_tokens_reached``,
...), and prime-rl's bridge for 0.3 envs maps those names onto v1's limits
(``max_turns_reached`` -> ``max_turns``; a truncated rollout with a name it does not know
-> ``max_output_tokens``). In interception mode ``CliAgentEnv`` checks them after every
turn; in gateway mode the gateway enforces the limits, so the limit it reports (the
trajectory's ``truncation_reason``, or the refusal on the exit channel) becomes the same
name, as ``CliAgentEnv`` would have stopped with:

=============================  ========================================
gateway                        verifiers 0.3 stop
=============================  ========================================
``max_turns``                  ``max_turns_reached``
``max_completion_tokens``      ``max_total_completion_tokens_reached``
``max_output_tokens``          ``max_total_completion_tokens_reached``
``max_context``                ``prompt_too_long`` (and ``is_truncated``)
``context_length_exceeded``    ``prompt_too_long`` (and ``is_truncated``)
``max_rollout_bytes``          ``prompt_too_long`` (and ``is_truncated``)
``max_input_tokens``           ``prompt_too_long`` (and ``is_truncated``)
``max_total_tokens``           ``prompt_too_long`` (and ``is_truncated``)
=============================  ========================================

As in ``CliAgentEnv``, only ``prompt_too_long`` marks the rollout ``is_truncated`` by
itself; the others leave it to the turns (a turn cut at its length is truncated).
"""

from __future__ import annotations

from collections.abc import Mapping

#: ``truncation_reason`` of the trajectory answer -> verifiers 0.3's stop condition.
TRUNCATION_STOPS: Mapping[str, str] = {
    "max_turns": "max_turns_reached",
    "max_completion_tokens": "max_total_completion_tokens_reached",
    "max_output_tokens": "max_total_completion_tokens_reached",
    "max_context": "prompt_too_long",
    "context_length_exceeded": "prompt_too_long",
    "max_rollout_bytes": "prompt_too_long",
    "max_input_tokens": "prompt_too_long",
    "max_total_tokens": "prompt_too_long",
}

#: A refused turn's code (the exit channel's ``refused``) -> the same names.
REFUSAL_STOPS: Mapping[str, str] = {
    "max_turns_reached": "max_turns_reached",
    "max_completion_tokens_reached": "max_total_completion_tokens_reached",
    "max_output_tokens_reached": "max_total_completion_tokens_reached",
    "max_context_reached": "prompt_too_long",
    "context_length_exceeded": "prompt_too_long",
    "max_rollout_bytes_reached": "prompt_too_long",
    "max_input_tokens_reached": "prompt_too_long",
    "max_total_tokens_reached": "prompt_too_long",
}

#: Every stop the table gives.
LIMIT_STOPS = frozenset({*TRUNCATION_STOPS.values(), *REFUSAL_STOPS.values()})

#: The stop that marks a rollout truncated by itself (``MultiTurnEnv``'s
#: ``prompt_too_long`` check sets ``is_truncated``).
TRUNCATING_STOPS = frozenset({"prompt_too_long"})


def limit_stop(truncation_reason: object, refused: object = None) -> str | None:
    """verifiers 0.3's stop for the limit the gateway reported: the trajectory's
    ``truncation_reason``, else the exit channel's refusal code (``None``: neither names
    a limit, e.g. a cancelled rollout)."""
    if isinstance(truncation_reason, str) and truncation_reason in TRUNCATION_STOPS:
        return TRUNCATION_STOPS[truncation_reason]
    if isinstance(refused, str):
        return REFUSAL_STOPS.get(refused)
    return None


__all__ = ["LIMIT_STOPS", "REFUSAL_STOPS", "TRUNCATING_STOPS", "TRUNCATION_STOPS", "limit_stop"]
