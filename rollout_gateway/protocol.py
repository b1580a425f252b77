"""The rollout gateway protocol (v1): paths, bodies and rollout ids.

Shared by the client (:mod:`rollout_gateway.client`) and the reference server
(:mod:`rollout_gateway.server`), so both sides agree on the wire format by construction.
Paths are relative to the gateway root (``http://host:port``, no ``/v1`` suffix).
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal, NotRequired, TypedDict
from urllib.parse import urlsplit, urlunsplit

RolloutStatus = Literal["active", "completed", "cancelled"]

#: Rollout ids are path segments: URL-safe characters only, bounded length.
ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

#: ``max_turns`` value meaning "no limit".
UNLIMITED_TURNS = -1


def new_rollout_id() -> str:
    """Return a fresh, unguessable rollout id (128 random bits, URL-safe)."""
    return f"rollout_{secrets.token_hex(16)}"


def is_valid_rollout_id(rollout_id: str) -> bool:
    """Whether ``rollout_id`` may be used as a path segment of the protocol."""
    return bool(ROLLOUT_ID_RE.fullmatch(rollout_id))


def gateway_root(base_url: str) -> str:
    """Gateway root from an OpenAI-style base URL: strip a trailing ``/`` and ``/v1``.

    ``http://h:8000/v1`` and ``http://h:8000/v1/`` give ``http://h:8000``; a URL
    without ``/v1`` is returned without its trailing slash.
    """
    url = base_url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def replace_port(url: str, port: int) -> str:
    """``url`` with its port replaced by ``port`` (scheme, host and path kept)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{port}"
    if parts.username:
        auth = parts.username + (f":{parts.password}" if parts.password else "")
        netloc = f"{auth}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def register_path(rollout_id: str) -> str:
    """Path of the register call."""
    return f"/v1/rollouts/{rollout_id}/register"


def chat_completions_path(rollout_id: str) -> str:
    """Path of the data-plane chat completions call."""
    return f"/v1/rollouts/{rollout_id}/chat/completions"


def trajectory_path(rollout_id: str) -> str:
    """Path of the trajectory call."""
    return f"/v1/rollouts/{rollout_id}/trajectory"


def cancel_path(rollout_id: str) -> str:
    """Path of the cancel call."""
    return f"/v1/rollouts/{rollout_id}/cancel"


def unregister_path(rollout_id: str) -> str:
    """Path of the unregister call."""
    return f"/v1/rollouts/{rollout_id}/unregister"


def rollout_base_url(public_root: str, rollout_id: str) -> str:
    """The agent's OpenAI base URL: the SDK appends ``/chat/completions`` to it."""
    return f"{public_root.rstrip('/')}/v1/rollouts/{rollout_id}"


class RegisterRequest(TypedDict):
    """Body of ``POST /v1/rollouts/{id}/register``."""

    model: str
    sampling_params: dict[str, Any]
    max_turns: int
    max_seq_len: int | None


class RegisterResponse(TypedDict):
    """Success body of register. ``api_key`` is our optional per-rollout credential."""

    rollout_id: str
    status: RolloutStatus
    model: str
    max_turns: int
    max_seq_len: int | None
    api_key: NotRequired[str]


class StepTokens(TypedDict):
    """Token-level record of one turn, as the trainer consumes it."""

    prompt_ids: list[int]
    prompt_mask: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    overlong_prompt: bool
    is_truncated: bool


class TrajectoryStepBody(TypedDict):
    """One step (turn) of a trajectory answer."""

    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    tokens: StepTokens | None
    reward: float | None
    advantage: float | None
    is_truncated: bool
    trajectory_id: str
    extras: dict[str, Any]


class TrajectoryResponse(TypedDict):
    """Success body of ``GET /v1/rollouts/{id}/trajectory``."""

    rollout_id: str
    status: RolloutStatus
    num_turns: int
    model: str
    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    is_truncated: bool
    trajectory: list[TrajectoryStepBody]
    #: Our optional addition: the limit that refused a turn (v1's stop-condition name).
    stop_condition: NotRequired[str]


class StatusResponse(TypedDict):
    """Success body of cancel and unregister."""

    rollout_id: str
    status: str


__all__ = [
    "ROLLOUT_ID_RE",
    "UNLIMITED_TURNS",
    "RegisterRequest",
    "RegisterResponse",
    "RolloutStatus",
    "StatusResponse",
    "StepTokens",
    "TrajectoryResponse",
    "TrajectoryStepBody",
    "cancel_path",
    "chat_completions_path",
    "gateway_root",
    "is_valid_rollout_id",
    "new_rollout_id",
    "register_path",
    "replace_port",
    "rollout_base_url",
    "trajectory_path",
    "unregister_path",
]


# -- verifiers v1 limits (optional register fields; a gateway may ignore them) ----------------

#: Token budgets of verifiers v1's ``RolloutLimits``, sent as extra register fields
#: (``{"max_input_tokens": int, ...}``); ``max_turns`` is the protocol's own field.
#: Counted as v1 counts them: input = new prompt tokens per turn (cache reads included),
#: output = completion tokens, total = both; soft by one turn (checked between turns).
TOKEN_LIMIT_FIELDS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")

#: Names a gateway reports in a trajectory's optional ``"stop_condition"`` when it refused
#: a turn because a limit was reached (v1's own stop-condition names).
LIMIT_STOP_CONDITIONS = ("max_turns", *TOKEN_LIMIT_FIELDS)


class TokenLimits(TypedDict, total=False):
    """Optional register fields: verifiers v1's token budgets for the rollout."""

    max_input_tokens: int
    max_output_tokens: int
    max_total_tokens: int


__all__ += ["LIMIT_STOP_CONDITIONS", "TOKEN_LIMIT_FIELDS", "TokenLimits"]
