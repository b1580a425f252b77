"""Per-rollout budgets: a runaway agent is stopped at the gateway, with a reason.

Every rollout has a turn budget (its registered ``max_turns``, else the gateway's
default), a budget of completion tokens over all its turns, a context bound (its
registered ``max_seq_len``, else the gateway's default, if any) and a budget of stored
message bytes. A turn past a budget is refused with :data:`TURN_REFUSED_STATUS` (a status
the OpenAI SDK does not retry) and an error ``code`` naming the limit
(:class:`TurnRefused`); the trajectory then reports ``is_truncated: true`` and
``truncation_reason`` (the caller tells the record's owner, :meth:`~rollout_gateway.
server.state.ledger.RolloutLedger.refuse`: nothing here changes the record).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from rollout_gateway.protocol import (
    TURN_REFUSED_STATUS,
    UNLIMITED_TURNS,
    TruncationReason,
    TurnRefusalCode,
)
from rollout_gateway.server.config import DEFAULT_MAX_TOTAL_COMPLETION_TOKENS
from rollout_gateway.server.http.responses import ApiError
from rollout_gateway.server.state.registry import RolloutRecord
from rollout_gateway.server.state.store import answer_matches

if TYPE_CHECKING:
    from rollout_gateway.server.state.stored import StoredRollouts

#: Header the OpenAI SDK honours to skip its retries (other clients go by the status).
NO_RETRY_HEADERS = {"x-should-retry": "false"}


class TurnRefused(ApiError):
    """The error answer of a refused turn, and the limit that refused it (``reason``;
    ``None``: the rollout is cancelled or completed)."""

    def __init__(
        self, record: RolloutRecord, code: TurnRefusalCode, message: str,
        reason: TruncationReason | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            TURN_REFUSED_STATUS,
            f"rollout {record.rollout_id}: {message}",
            "turn_refused",
            code=code,
            headers=NO_RETRY_HEADERS,
        )
        self.reason = reason


def check_turn_allowed(
    record: RolloutRecord, *, extends_history: bool, new_message_bytes: int = 0
) -> None:
    """Raise the refusal (:class:`TurnRefused`) of the next turn of ``record`` if any
    budget forbids it.

    ``extends_history``: the request's messages extend the previous turn's prompt and
    answer, so its prompt is at least as long as that turn's context.
    ``new_message_bytes``: bytes of the messages this turn would add to the record.
    """
    if record.status == "cancelled":
        raise TurnRefused(record, "rollout_cancelled", "the rollout is cancelled")
    if record.max_turns != UNLIMITED_TURNS and record.num_turns >= record.max_turns:
        message = f"turn limit reached (max_turns={record.max_turns})"
        raise TurnRefused(record, "max_turns_reached", message, "max_turns")
    if record.status == "completed":
        raise TurnRefused(record, "rollout_completed", "the rollout is completed")
    if record.token_budget is not None and (limit := record.token_budget.reached()):
        # verifiers v1's token caps (server/state/limits_v1.py): v1's names for reason and code.
        code = cast(TurnRefusalCode, f"{limit}_reached")
        message = f"verifiers limit reached ({limit})"
        raise TurnRefused(record, code, message, cast(TruncationReason, limit))
    budget = record.max_total_completion_tokens
    if budget is not None and record.completion_tokens >= budget:
        message = f"completion token budget spent ({record.completion_tokens} >= {budget})"
        raise TurnRefused(record, "max_completion_tokens_reached", message, "max_completion_tokens")
    context = record.max_context_tokens
    last = record.recorder.last_context_tokens
    if context is not None and extends_history and last >= context:
        message = f"context limit reached ({last} >= {context} tokens)"
        raise TurnRefused(record, "max_context_reached", message, "max_context")
    stored = record.message_bytes + new_message_bytes
    if record.max_message_bytes is not None and stored > record.max_message_bytes:
        message = f"stored message budget spent ({record.max_message_bytes} bytes)"
        raise TurnRefused(record, "max_rollout_bytes_reached", message, "max_rollout_bytes")


def check_takes_turn(
    record: RolloutRecord,
    rollouts: StoredRollouts,
    fingerprint: bytes,
    idempotency_key: str | None,
    *,
    is_retry: bool,
) -> None:
    """Raise the refusal of a request to a rollout that takes no more turns (cancelled,
    completed, or at a limit), before its body is parsed: one agent sending big bodies to
    its finished rollout then costs the gateway a read and a hash each, not a parse.

    Nothing is raised where the parsed path decides: when this process's copy of the
    rollout may not be current (the turn's claim brings it up to date: a copy of a
    rollout other gateways share, a restored record), when the request repeats an earlier turn (a
    retry gets that turn's answer, from the turn tracker or from the store), when the last
    answer reached nobody (the next turn takes it back: see ``TurnRunner._admit``), or
    when the rollout is gone (its turn answers 404).
    """
    if not rollouts.vouches_for(record) or not record.live:
        return
    if record.status != "cancelled":
        if record.turns.match(fingerprint, idempotency_key, is_retry=is_retry) is not None:
            return
        last = record.turns.last
        if last is not None and last.recorded and not last.delivered and last.waiters <= 0:
            return
        key = record.answer_key
        if key is not None and answer_matches(
            key, fingerprint, idempotency_key, is_retry=is_retry,
            now=rollouts.wall_clock(), window_s=rollouts.retry_window_s,
        ):  # fmt: skip
            return
    check_turn_allowed(record, extends_history=False)


def budget_bound(record: RolloutRecord, *, extends_history: bool, window: int | None) -> int | None:
    """The most completion tokens the rollout's own budgets leave its next turn
    (``None``: no budget of the rollout's bounds it).

    The completion budget counts where someone set it: the gateway's default
    (:data:`~rollout_gateway.server.config.DEFAULT_MAX_TOTAL_COMPLETION_TOKENS`) stands
    in for "no limit", and is enforced between turns only. The context bound counts
    where it is tighter than the engine's own context ``window`` (a rollout registered
    without ``max_seq_len`` is bounded by the engine's context, which the engine
    enforces itself), and only when the request extends the recorded history (its
    prompt then holds at least the previous turn's context). With the engine's context
    unknown (its model card not read yet) the context bound is enforced between turns
    only: what is sent then does not depend on whether a probe answered in time.
    """
    bounds: list[int] = []
    spent = record.completion_tokens
    budget = record.max_total_completion_tokens
    if budget is not None and budget < DEFAULT_MAX_TOTAL_COMPLETION_TOKENS:
        bounds.append(budget - spent)
    context = record.max_context_tokens
    if context is not None and extends_history and window is not None and context < window:
        bounds.append(context - record.recorder.last_context_tokens)
    return max(1, min(bounds)) if bounds else None


__all__ = [
    "NO_RETRY_HEADERS",
    "check_takes_turn",
    "check_turn_allowed",
    "budget_bound",
    "TurnRefused",
]
