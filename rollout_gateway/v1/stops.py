"""The gateway's limits and refusals under verifiers v1's names for them.

A trace's ``stop_condition`` feeds v1's ``Trace.is_truncated`` (true for v1's limit
names: ``max_turns``, ``max_input_tokens``, ``max_output_tokens``, ``max_total_tokens``,
``compaction_failed``; or when the last answered call finished ``length``), prime-rl's
dashboards (``stop_condition/<name>``, ``generation_truncated``) and v1's retry rules
(the error *type*). So the adapter sets no name of its own: every limit the gateway
reports (its ``truncation_reason``, a refusal code on the exit channel) becomes the v1
limit it means, as v1's own RLM harness maps its engine's budgets onto these names
(``token_budget`` -> ``max_output_tokens``):

=============================  ==================  =======================================
gateway                        v1 stop             why that name
=============================  ==================  =======================================
``max_turns``                  ``max_turns``       v1's own limit, enforced at the gateway
``max_input_tokens`` ...       the same name       v1's own token caps (``limits_v1``)
``max_completion_tokens``      ``max_output_tokens``  completion tokens over the rollout
``max_context``                ``max_total_tokens``   the registered ``max_seq_len``: the
                                                   rollout's context is full (v1 bounds the
                                                   tokens of a rollout only by total)
``context_length_exceeded``    ``max_total_tokens``   the engine's context is full
``max_rollout_bytes``          ``max_total_tokens``   the conversation outgrew the gateway's
                                                   message budget
=============================  ==================  =======================================

A cancelled rollout (``rollout_cancelled``) is one the env itself cancelled: v1 already
knows why. ``rollout_completed`` follows an earlier refusal, whose reason the trajectory's
``truncation_reason`` names. Errors keep v1's boundary names (``v1.stop_condition`` of the class):
``provider_error``, ``interception_error``, ``tunnel_error``, ``task_error``.
"""

from __future__ import annotations

from collections.abc import Mapping

#: ``truncation_reason`` of the trajectory answer -> v1's stop condition.
TRUNCATION_STOPS: Mapping[str, str] = {
    "max_turns": "max_turns",
    "max_input_tokens": "max_input_tokens",
    "max_output_tokens": "max_output_tokens",
    "max_total_tokens": "max_total_tokens",
    "max_completion_tokens": "max_output_tokens",
    "max_context": "max_total_tokens",
    "context_length_exceeded": "max_total_tokens",
    "max_rollout_bytes": "max_total_tokens",
}

#: A refused turn's ``error.code`` (and an exit report's ``refused``) -> v1's stop.
REFUSAL_STOPS: Mapping[str, str] = {
    "max_turns_reached": "max_turns",
    "max_input_tokens_reached": "max_input_tokens",
    "max_output_tokens_reached": "max_output_tokens",
    "max_total_tokens_reached": "max_total_tokens",
    "max_completion_tokens_reached": "max_output_tokens",
    "max_context_reached": "max_total_tokens",
    "context_length_exceeded": "max_total_tokens",
    "max_rollout_bytes_reached": "max_total_tokens",
}

#: The limit names v1 counts as truncation (``Trace.is_truncated``), as of verifiers 0.4.
V1_TRUNCATING_STOPS = frozenset(
    {"max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed"}
)

#: Every stop condition the adapter can leave on a trace: the limits above and the
#: ``<boundary>_error`` names of the errors it raises (v1 derives those from the class).
ADAPTER_STOPS = frozenset(
    {
        *TRUNCATION_STOPS.values(),
        *REFUSAL_STOPS.values(),
        "provider_error",
        "interception_error",
        "tunnel_error",
        "task_error",
    }
)


#: The stop of a truncation reason this table does not know (another gateway's): prime-rl's
#: own fallback for a truncated rollout whose stop it does not know (its legacy bridge).
UNKNOWN_LIMIT_STOP = "max_output_tokens"


def limit_stop(truncation_reason: object) -> str | None:
    """v1's stop for a trajectory's ``truncation_reason`` (``None`` when there is none;
    :data:`UNKNOWN_LIMIT_STOP` for a reason the table does not know)."""
    if not isinstance(truncation_reason, str) or not truncation_reason:
        return None
    return TRUNCATION_STOPS.get(truncation_reason, UNKNOWN_LIMIT_STOP)


def refusal_stop(code: object) -> str | None:
    """v1's stop for a refused turn's code (``None``: not a limit, e.g. cancelled)."""
    if not isinstance(code, str):
        return None
    return REFUSAL_STOPS.get(code)


__all__ = [
    "ADAPTER_STOPS",
    "REFUSAL_STOPS",
    "TRUNCATION_STOPS",
    "UNKNOWN_LIMIT_STOP",
    "V1_TRUNCATING_STOPS",
    "limit_stop",
    "refusal_stop",
]
