"""A rollout record as the store keeps it, and back: :class:`~.store.RolloutRow`.

What register fixed goes into the row's :class:`~.store.Registration` (written once);
what turns and the control plane change goes into its :class:`~.store.RolloutCounters`
(rewritten on each change). The process-local parts of a record (its lock, its turn
queue, its recorder's digests) are not stored; the recorder's steps are stored one by one
(:meth:`~.store.RolloutStore.commit_turn`) and replayed on load.
"""

from __future__ import annotations

import time
from typing import Any, cast

from rollout_gateway.protocol import RolloutStatus, TruncationReason
from rollout_gateway.server.state.limits_v1 import TokenBudget
from rollout_gateway.server.state.registry import Clock, RolloutRecord
from rollout_gateway.server.state.store import Registration, RolloutCounters, RolloutRow

_TOKEN_CAPS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")


def registration_of(record: RolloutRecord) -> Registration:
    """What register fixed for ``record``."""
    budget = record.token_budget
    caps = None
    if budget is not None:
        caps = {name: getattr(budget, name) for name in _TOKEN_CAPS}
        caps = {name: value for name, value in caps.items() if value is not None}
    return {
        "rollout_id": record.rollout_id,
        "model": record.model,
        "sampling_params": record.sampling_params,
        "max_turns": record.max_turns,
        "max_seq_len": record.max_seq_len,
        "upstream": record.upstream,
        "key_digest": record.key_digest,
        "trajectory_id": record.trajectory_id,
        "max_total_completion_tokens": record.max_total_completion_tokens,
        "max_context_tokens": record.max_context_tokens,
        "max_message_bytes": record.max_message_bytes,
        "token_caps": caps,
        "registered_at": record.registered_at,
    }


def counters_of(record: RolloutRecord, now: float | None = None) -> RolloutCounters:
    """What ``record``'s turns and the control plane changed so far (a field at its
    default is left out: a durable store keeps these with every turn)."""
    counters: RolloutCounters = {  # (built as the TypedDict: no cast call every turn)
        "status": record.status,
        "num_turns": record.num_turns,
        "updated_at": time.time() if now is None else now,
    }
    if record.completion_tokens:
        counters["completion_tokens"] = record.completion_tokens
    if record.message_bytes:
        counters["message_bytes"] = record.message_bytes
    if record.truncation_reason is not None:
        counters["truncation_reason"] = record.truncation_reason
    budget = record.token_budget
    if budget is not None:
        counters["input_tokens"] = budget.input_tokens
        counters["output_tokens"] = budget.output_tokens
        counters["previous_total"] = budget.previous_total
    if record.recorder.num_abandoned:
        counters["abandoned"] = record.recorder.abandoned_indexes()
    if record.failed_turns:
        counters["failed_turns"] = list(record.failed_turns)
    return counters


def new_row(record: RolloutRecord) -> RolloutRow:
    """The row of a rollout just registered."""
    return RolloutRow(registration_of(record), counters_of(record), revision=0, steps=0)


def record_of(row: RolloutRow, *, clock: Clock, wall_clock: Clock = time.time) -> RolloutRecord:
    """A record for a stored rollout, its steps not loaded yet (``loaded`` is false).

    Its idle time goes on from the row's last change (a rollout that idled past its TTL
    while the gateway was down expires at the next sweep).
    """
    reg = row.registration
    caps = reg.get("token_caps")
    now = wall_clock()
    idle_s = max(0.0, now - row.counters.get("updated_at", now))
    record = RolloutRecord(
        rollout_id=reg["rollout_id"],
        model=reg["model"],
        sampling_params=dict(reg.get("sampling_params") or {}),
        max_turns=reg["max_turns"],
        max_seq_len=reg.get("max_seq_len"),
        upstream=reg["upstream"],
        last_activity=clock() - idle_s,
        key_digest=reg.get("key_digest"),
        max_total_completion_tokens=reg.get("max_total_completion_tokens"),
        max_context_tokens=reg.get("max_context_tokens"),
        max_message_bytes=reg.get("max_message_bytes"),
        token_budget=TokenBudget(**caps) if caps else None,
        trajectory_id=reg["trajectory_id"],
        registered_at=reg.get("registered_at", 0.0),
    )
    apply_row(record, row)
    record.loaded = row.steps == 0
    return record


def apply_row(record: RolloutRecord, row: RolloutRow) -> None:
    """Make ``record``'s counters the row's (its steps are loaded separately)."""
    counters = row.counters
    status: Any = "cancelled" if row.cancelled else counters.get("status", "active")
    record.status = cast(RolloutStatus, status)
    record.num_turns = counters.get("num_turns", 0)
    record.completion_tokens = counters.get("completion_tokens", 0)
    record.message_bytes = counters.get("message_bytes", 0)
    record.truncation_reason = cast(TruncationReason | None, counters.get("truncation_reason"))
    record.failed_turns = list(counters.get("failed_turns") or [])
    budget = record.token_budget
    if budget is not None:
        budget.input_tokens = counters.get("input_tokens", 0)
        budget.output_tokens = counters.get("output_tokens", 0)
        budget.previous_total = counters.get("previous_total", 0)
    record.revision = row.revision
    record.answer_key = row.answer_key


__all__ = ["apply_row", "counters_of", "new_row", "record_of", "registration_of"]
