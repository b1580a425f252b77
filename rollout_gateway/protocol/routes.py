"""The protocol's routes: rollout ids, route templates, the paths clients fill in.

Paths are relative to the gateway root (``http://host:port``, no ``/v1`` suffix). The
server routes on the ``*_ROUTE`` templates; clients and fakes build paths with the
``*_path`` functions, so both sides agree by construction.
"""

from __future__ import annotations

import re
import secrets

#: Rollout ids are path segments: URL-safe characters only, bounded length.
ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

#: A proposed per-rollout key: URL-safe, long enough to be unguessable.
API_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{32,256}$")


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


def is_valid_rollout_id(rollout_id: str) -> bool:
    """Whether ``rollout_id`` may be used as a path segment of the protocol."""
    return bool(ROLLOUT_ID_RE.fullmatch(rollout_id))


#: Route templates of the per-rollout calls (``{rollout_id}`` is one path segment). The
#: server routes on them; the ``*_path`` functions below fill them in for clients.
ROLLOUT_PREFIX = "/v1/rollouts/{rollout_id}"
REGISTER_ROUTE = ROLLOUT_PREFIX + "/register"
CHAT_COMPLETIONS_ROUTE = ROLLOUT_PREFIX + "/chat/completions"
TRAJECTORY_ROUTE = ROLLOUT_PREFIX + "/trajectory"
CANCEL_ROUTE = ROLLOUT_PREFIX + "/cancel"
UNREGISTER_ROUTE = ROLLOUT_PREFIX + "/unregister"
EXIT_ROUTE = ROLLOUT_PREFIX + "/exit"
MODELS_ROUTE = ROLLOUT_PREFIX + "/models"

#: Bearer-key routed data plane (the rollout is found by its per-rollout key, for agents
#: that cannot carry the rollout id in their base URL, e.g. verifiers v1 harnesses).
BEARER_CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
BEARER_MODELS_PATH = "/v1/models"

#: Control-plane path where the trainer announces a new policy version (admin token).
POLICY_VERSION_PATH = "/v1/policy/version"

#: Path of the exit reports (control plane, admin token): the long-poll
#: ``GET ?after=<seq>&timeout=<s>`` answers :class:`~.exit_stream.ExitsResponse`; the
#: stream ``GET ?after=<seq>&stream=1`` answers
#: :data:`~.exit_stream.EXIT_STREAM_MEDIA_TYPE` lines.
EXITS_PATH = "/v1/rollouts/exits"

#: Headers by which a client marks a retry (the OpenAI SDK's and the generic one).
SDK_RETRY_COUNT_HEADER = "x-stainless-retry-count"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"

_ROLLOUT_PATH_RE = re.compile(r"^/v1/rollouts/([^/]+)/(.+)$")


def parse_rollout_path(path: str) -> tuple[str, str] | None:
    """``(rollout_id, operation)`` of a per-rollout path; operation as ``"chat/completions"``."""
    match = _ROLLOUT_PATH_RE.fullmatch(path)
    return (match.group(1), match.group(2)) if match else None


def register_path(rollout_id: str) -> str:
    """Path of the register call."""
    return REGISTER_ROUTE.format(rollout_id=rollout_id)


def chat_completions_path(rollout_id: str) -> str:
    """Path of the data-plane chat completions call."""
    return CHAT_COMPLETIONS_ROUTE.format(rollout_id=rollout_id)


def trajectory_path(rollout_id: str) -> str:
    """Path of the trajectory call."""
    return TRAJECTORY_ROUTE.format(rollout_id=rollout_id)


def cancel_path(rollout_id: str) -> str:
    """Path of the cancel call."""
    return CANCEL_ROUTE.format(rollout_id=rollout_id)


def unregister_path(rollout_id: str) -> str:
    """Path of the unregister call."""
    return UNREGISTER_ROUTE.format(rollout_id=rollout_id)


def exit_path(rollout_id: str) -> str:
    """Path of the agent's exit report (data plane: the agent's launch wrapper calls it)."""
    return EXIT_ROUTE.format(rollout_id=rollout_id)


def exits_query(
    after: int, *, timeout: float | None = None, stream: bool = False
) -> dict[str, str]:
    """Query of :data:`EXITS_PATH`: the long-poll (``timeout``) or the stream."""
    query = {"after": str(after)}
    if stream:
        query["stream"] = "1"
    if timeout is not None:
        query["timeout"] = f"{timeout:g}"
    return query


__all__ = [
    "API_KEY_RE",
    "BEARER_CHAT_COMPLETIONS_PATH",
    "BEARER_MODELS_PATH",
    "CANCEL_ROUTE",
    "CHAT_COMPLETIONS_ROUTE",
    "EXITS_PATH",
    "EXIT_ROUTE",
    "IDEMPOTENCY_KEY_HEADER",
    "MODELS_ROUTE",
    "POLICY_VERSION_PATH",
    "REGISTER_ROUTE",
    "ROLLOUT_ID_RE",
    "ROLLOUT_PREFIX",
    "SDK_RETRY_COUNT_HEADER",
    "TRAJECTORY_ROUTE",
    "UNREGISTER_ROUTE",
    "cancel_path",
    "chat_completions_path",
    "exit_path",
    "exits_query",
    "is_valid_rollout_id",
    "new_rollout_api_key",
    "new_rollout_id",
    "parse_rollout_path",
    "register_path",
    "trajectory_path",
    "unregister_path",
]
