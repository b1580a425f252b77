"""The rollout gateway protocol (v1): paths, bodies and rollout ids.

Shared by the client (:mod:`rollout_gateway.client`) and the reference server
(:mod:`rollout_gateway.server`), so both sides agree on the wire format by construction.
Paths are relative to the gateway root (``http://host:port``, no ``/v1`` suffix).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict, cast
from urllib.parse import urlsplit, urlunsplit

RolloutStatus = Literal["active", "completed", "cancelled"]

#: Rollout ids are path segments: URL-safe characters only, bounded length.
ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

#: ``max_turns`` value meaning "no limit".
UNLIMITED_TURNS = -1


def new_rollout_id() -> str:
    """Return a fresh, unguessable rollout id (128 random bits, URL-safe)."""
    return f"rollout_{secrets.token_hex(16)}"


def new_rollout_api_key() -> str:
    """Return a fresh per-rollout data-plane key (256 random bits, URL-safe).

    The env proposes it in the register body; a gateway that honours the proposal uses
    it as the rollout's bearer key, so a register retried after a lost answer still
    leaves the env knowing the key.
    """
    return f"rk_{secrets.token_urlsafe(32)}"


#: A proposed per-rollout key: URL-safe, long enough to be unguessable.
API_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{32,256}$")


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


def gateway_host(url: str) -> str:
    """The host name of a gateway URL (what a tunnel's ``local_addr`` names)."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"gateway URL {url!r} has no host")
    return host


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


def exit_path(rollout_id: str) -> str:
    """Path of the agent's exit report (data plane: the agent's launch wrapper calls it)."""
    return f"/v1/rollouts/{rollout_id}/exit"


#: Path of the exit-report long-poll (control plane): ``GET ?after=<seq>&timeout=<s>``.
EXITS_PATH = "/v1/rollouts/exits"
#: The longest a long-poll of :data:`EXITS_PATH` may wait, in seconds.
EXITS_MAX_WAIT = 30.0


def rollout_base_url(public_root: str, rollout_id: str) -> str:
    """The agent's OpenAI base URL: the SDK appends ``/chat/completions`` to it."""
    return f"{public_root.rstrip('/')}/v1/rollouts/{rollout_id}"


class RegisterRequest(TypedDict):
    """Body of ``POST /v1/rollouts/{id}/register``.

    ``api_key`` is our optional addition: the env's proposed per-rollout key.
    """

    model: str
    sampling_params: dict[str, Any]
    max_turns: int
    max_seq_len: int | None
    api_key: NotRequired[str]


class RegisterResponse(TypedDict):
    """Success body of register. ``api_key`` is our optional per-rollout credential."""

    rollout_id: str
    status: RolloutStatus
    model: str
    max_turns: int
    max_seq_len: int | None
    api_key: NotRequired[str]


def register_request(
    *,
    model: str,
    sampling_params: dict[str, Any] | None = None,
    max_turns: int = UNLIMITED_TURNS,
    max_seq_len: int | None = None,
    api_key: str | None = None,
    extra: dict[str, Any] | None = None,
) -> RegisterRequest:
    """The register body; ``api_key`` and ``extra`` fields only when given."""
    body: dict[str, Any] = dict(extra or {})
    body.update(
        model=model,
        sampling_params=dict(sampling_params or {}),
        max_turns=max_turns,
        max_seq_len=max_seq_len,
    )
    if api_key is not None:
        body["api_key"] = api_key
    return cast(RegisterRequest, body)


def register_response(
    rollout_id: str, request: RegisterRequest, *, api_key: str | None = None
) -> RegisterResponse:
    """The register answer for ``request`` (server, fakes, and a client's retried 409).

    ``api_key`` defaults to the key the request proposed.
    """
    answer: dict[str, Any] = {
        "rollout_id": rollout_id,
        "status": "active",
        "model": request["model"],
        "max_turns": request["max_turns"],
        "max_seq_len": request["max_seq_len"],
    }
    key = api_key if api_key is not None else request.get("api_key")
    if key is not None:
        answer["api_key"] = key
    return cast(RegisterResponse, answer)


def flatten_sampling_args(*sources: Mapping[str, Any] | None) -> dict[str, Any]:
    """Sampling params from OpenAI-style sampling args, later sources winning.

    Within one source, ``extra_body`` entries (vLLM extensions such as ``top_k``) are
    flattened in and a top-level field wins over the same name in ``extra_body`` (as the
    OpenAI SDK merges them). ``n`` is dropped (one completion per turn) and ``None``
    values are skipped. The one place this is done, for the client and the server.
    """
    params: dict[str, Any] = {}
    for source in sources:
        if not source:
            continue
        extra = source.get("extra_body")
        if isinstance(extra, Mapping):
            params.update({k: v for k, v in extra.items() if v is not None})
        params.update({k: v for k, v in source.items() if k != "extra_body" and v is not None})
    params.pop("n", None)
    return params


class ExitReport(TypedDict):
    """One agent exit as its launch wrapper reported it: a hint, to be confirmed.

    The agent holds the key the report is made with, so the env must confirm a report
    with the sandbox before it trusts it.
    """

    rollout_id: str
    exit_code: int | None
    seq: int


class ExitsResponse(TypedDict):
    """Answer of the exits long-poll: reports with ``seq`` above ``after``, and the cursor."""

    exits: list[ExitReport]
    cursor: int


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


class StatusResponse(TypedDict):
    """Success body of cancel and unregister."""

    rollout_id: str
    status: str


__all__ = [
    "API_KEY_RE",
    "EXITS_MAX_WAIT",
    "EXITS_PATH",
    "ExitReport",
    "ExitsResponse",
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
    "exit_path",
    "flatten_sampling_args",
    "gateway_host",
    "gateway_root",
    "is_valid_rollout_id",
    "new_rollout_api_key",
    "new_rollout_id",
    "register_path",
    "register_request",
    "register_response",
    "replace_port",
    "rollout_base_url",
    "trajectory_path",
    "unregister_path",
]
