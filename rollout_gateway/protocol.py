"""The rollout gateway protocol (v1): paths, bodies and rollout ids.

Shared by the client (:mod:`rollout_gateway.client`) and the reference server
(:mod:`rollout_gateway.server`), so both sides agree on the wire format by construction.
Paths are relative to the gateway root (``http://host:port``, no ``/v1`` suffix).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NotRequired, TypedDict, cast
from urllib.parse import urlsplit, urlunsplit

import orjson

RolloutStatus = Literal["active", "completed", "cancelled"]

#: Rollout ids are path segments: URL-safe characters only, bounded length.
ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

#: ``max_turns`` value meaning "no limit".
UNLIMITED_TURNS = -1


#: Status of a refused chat turn (rollout cancelled, completed, or at one of its limits).
#: Not 409 as in the original table: the OpenAI SDK (and litellm) retry 408, 409, 429 and
#: 5xx, so an agent would re-send a refused turn for minutes. The error's ``code`` says
#: why (one of :data:`TURN_REFUSAL_CODES`); refusals also carry ``x-should-retry: false``.
TURN_REFUSED_STATUS = 403

#: ``error.code`` values of a refused turn.
TurnRefusalCode = Literal[
    "rollout_cancelled",
    "rollout_completed",
    "max_turns_reached",
    "max_completion_tokens_reached",
    "max_context_reached",
    "max_rollout_bytes_reached",
    "max_input_tokens_reached",
    "max_output_tokens_reached",
    "max_total_tokens_reached",
]
TURN_REFUSAL_CODES: tuple[str, ...] = TurnRefusalCode.__args__  # type: ignore[attr-defined]

#: ``error.code`` of an error answer that names no more specific code. Every error answer
#: is ``{"error": {"message", "type", "code"}}`` and its ``code`` is always a string, as in
#: OpenAI's API (never the HTTP status number): a specific one where the gateway has it
#: (``rollout_not_found``, ``max_turns_reached``, ``context_length_exceeded``...), else
#: the status's name from this table.
STATUS_ERROR_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "unprocessable_entity",
    429: "too_many_requests",
    431: "request_headers_too_large",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


def error_code(status: int) -> str:
    """The ``error.code`` of an error answer with ``status`` and no more specific code."""
    return STATUS_ERROR_CODES.get(status, f"http_{status}")


#: Why a trajectory is truncated (``truncation_reason`` of the trajectory answer): the
#: limit that refused a turn the agent asked for, or ``context_length_exceeded`` when the
#: engine refused a prompt longer than its context (that turn is recorded, no sample).
#: ``max_input_tokens`` / ``max_output_tokens`` / ``max_total_tokens``: verifiers v1's token
#: budgets (:data:`TOKEN_LIMIT_FIELDS`), which a rollout may register.
TruncationReason = Literal[
    "max_turns",
    "max_completion_tokens",
    "max_context",
    "max_rollout_bytes",
    "context_length_exceeded",
    "max_input_tokens",
    "max_output_tokens",
    "max_total_tokens",
]

#: Bearer-key routed data plane (the rollout is found by its per-rollout key, for agents
#: that cannot carry the rollout id in their base URL, e.g. verifiers v1 harnesses).
BEARER_CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
BEARER_MODELS_PATH = "/v1/models"

#: Headers by which a client marks a retry (the OpenAI SDK's and the generic one).
SDK_RETRY_COUNT_HEADER = "x-stainless-retry-count"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"


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


#: Control-plane path where the trainer announces a new policy version (admin token).
POLICY_VERSION_PATH = "/v1/policy/version"


def unregister_path(rollout_id: str) -> str:
    """Path of the unregister call."""
    return UNREGISTER_ROUTE.format(rollout_id=rollout_id)


def exit_path(rollout_id: str) -> str:
    """Path of the agent's exit report (data plane: the agent's launch wrapper calls it)."""
    return EXIT_ROUTE.format(rollout_id=rollout_id)


#: Path of the exit reports (control plane, admin token): the long-poll
#: ``GET ?after=<seq>&timeout=<s>`` answers :class:`ExitsResponse`; the stream
#: ``GET ?after=<seq>&stream=1`` answers :data:`EXIT_STREAM_MEDIA_TYPE` lines.
EXITS_PATH = "/v1/rollouts/exits"
#: The longest a long-poll of :data:`EXITS_PATH` may wait, in seconds.
EXITS_MAX_WAIT = 30.0

#: Media type of the exit stream: newline-delimited JSON, one object per line, each an
#: :class:`ExitReport` or an :class:`ExitStreamHeartbeat`. Not SSE: the cursor already
#: is the resume point (SSE's event ids and ``retry`` would repeat it), the client is our
#: env and not a browser, and a line is one ``orjson.loads``. A gateway that does not
#: know ``stream=1`` answers the plain long-poll JSON, which a client tells apart by
#: this media type.
EXIT_STREAM_MEDIA_TYPE = "application/x-ndjson"
#: Seconds without a report after which the gateway sends a heartbeat line.
EXIT_STREAM_KEEPALIVE = 10.0
#: Seconds without any line after which a client takes the connection for dead (three
#: missed heartbeats) and reconnects from its cursor.
EXIT_STREAM_IDLE_TIMEOUT = 3 * EXIT_STREAM_KEEPALIVE
#: The longest line a client accepts (a report is about 100 bytes).
EXIT_STREAM_MAX_LINE = 64 * 1024


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
    #: Our addition: completion tokens of the whole rollout (gateway default when absent).
    max_total_completion_tokens: NotRequired[int | None]


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
    OpenAI SDK merges them), and ``None`` values are skipped. The one place this is
    done, for the client and the server.
    """
    params: dict[str, Any] = {}
    for source in sources:
        if not source:
            continue
        extra = source.get("extra_body")
        if isinstance(extra, Mapping):
            params.update({k: v for k, v in extra.items() if v is not None})
        params.update({k: v for k, v in source.items() if k != "extra_body" and v is not None})
    return params


class ExitReport(TypedDict):
    """One report on the exit channel about a rollout's agent.

    - An agent exit, as its launch wrapper reported it: a hint, to be confirmed. The
      agent holds the key the report is made with, so the env must confirm it with the
      sandbox before it trusts it.
    - ``started``: the launch wrapper started the agent and can report its exit (it has
      an HTTP client); an env that hears nothing of the kind polls the sandbox instead.
    - ``refused``: the gateway itself refused a turn of the rollout (the refusal's code,
      :data:`TurnRefusalCode` or ``context_length_exceeded``): the rollout is over and the
      env should stop its agent now, whatever the agent does. Only the gateway makes
      these (an agent's own report cannot carry it), and a later report of the agent
      keeps it.
    """

    rollout_id: str
    exit_code: int | None
    seq: int
    started: NotRequired[bool]
    refused: NotRequired[str]


class ExitsResponse(TypedDict):
    """Answer of the exits long-poll: reports with ``seq`` above ``after``, and the cursor."""

    exits: list[ExitReport]
    cursor: int


class ExitStreamHeartbeat(TypedDict):
    """A line of the exit stream that is not a report: the stream's cursor.

    Sent first (so a client knows the stream is served before any agent exits), then
    after every :data:`EXIT_STREAM_KEEPALIVE` s without a report. Every report up to
    ``cursor`` was sent before it, so a client resumes from it; after a gateway restart
    it is lower than the client's cursor, which then follows it down.
    """

    cursor: int


ExitStreamLine = ExitReport | ExitStreamHeartbeat
"""One line of the exit stream."""


def exit_stream_line(line: ExitStreamLine) -> bytes:
    """``line`` encoded for the exit stream (JSON and a newline)."""
    return orjson.dumps(line) + b"\n"


def parse_exit_stream_line(raw: bytes | str) -> ExitStreamLine:
    """One exit stream line, parsed and checked. Raises ``ValueError`` on anything else."""
    return check_exit_stream_line(orjson.loads(raw))


def check_exit_stream_line(data: Any) -> ExitStreamLine:
    """``data`` if it is an :class:`ExitReport` or an :class:`ExitStreamHeartbeat`.

    Raises ``ValueError`` otherwise.
    """
    if not isinstance(data, dict) or not _is_int(data.get("cursor", data.get("seq"))):
        raise ValueError("an exit stream line needs an integer 'seq' or 'cursor'")
    if "rollout_id" not in data:
        return cast(ExitStreamHeartbeat, data)
    code = data.get("exit_code")
    if not isinstance(data["rollout_id"], str) or not _is_int(data.get("seq")):
        raise ValueError("an exit report needs a string 'rollout_id' and an integer 'seq'")
    if code is not None and not _is_int(code):
        raise ValueError("an exit report's 'exit_code' must be an integer or null")
    if "refused" in data and not isinstance(data["refused"], str):
        raise ValueError("an exit report's 'refused' must be a string")
    if "started" in data and not isinstance(data["started"], bool):
        raise ValueError("an exit report's 'started' must be true or false")
    return cast(ExitReport, data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StepTokens(TypedDict):
    """Token-level record of one turn, as the trainer consumes it."""

    prompt_ids: list[int]
    prompt_mask: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    overlong_prompt: bool
    is_truncated: bool
    #: MoE router replay (token-in mode with an engine that returns it): the expert ids
    #: per position, ``{"data": base64 of uint8/uint16 [positions, layers, top_k],
    #: "shape", "start", "dtype"}``, positions ``start ..`` of ``prompt_ids +
    #: completion_ids`` (verifiers' ``RoutedExperts`` / ``RoutedExpertsPayload``).
    routed_experts: NotRequired[dict[str, Any]]


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


class TurnTiming(TypedDict):
    """When a turn ran and how long its parts took (``StepExtras.timing``)."""

    #: Unix time (seconds) the gateway sent the turn upstream.
    started_at: float
    #: Seconds until the upstream's first byte of answer (first chunk when streamed).
    first_token_s: float | None
    #: Seconds the upstream call took, answer complete.
    upstream_s: float


class TurnError(TypedDict):
    """Why a recorded turn produced no sample (``StepExtras.error``)."""

    #: ``context_length_exceeded`` (the prompt does not fit the engine's context), ...
    type: str
    message: str
    #: HTTP status the gateway answered the agent.
    status_code: int
    #: The engine's own HTTP status, when it answered with an error (a failed turn).
    upstream_status: NotRequired[int]


class FailedTurn(TypedDict):
    """A turn whose engine call failed (5xx, unreachable, timeout, a 4xx other than a
    context overflow): no sample, so no step; the agent got the error and may retry."""

    #: Steps recorded before it (the failed call came between step ``after_steps - 1``
    #: and step ``after_steps``).
    after_steps: int
    error: TurnError
    timing: TurnTiming


class StepExtras(TypedDict, total=False):
    """Per-turn facts the reference gateway records in a step's ``extras``.

    All keys are optional on the wire (another gateway may send none of them). A trainer
    reads them to filter or weight turns: ``policy_version`` for staleness,
    ``prefix_break`` for turns whose prompt does not extend the previous turn's ids,
    ``status`` for turns that produced no sample.
    """

    #: ``"ok"``: a sample was taken; ``"error"``: the turn was refused by the engine and
    #: recorded for the trainer's sake (e.g. context overflow), with ``error``.
    status: Literal["ok", "error"]
    error: TurnError
    #: The engine's ``finish_reason`` (``stop``, ``length``, ``tool_calls``, ``abort``...).
    finish_reason: str | None
    #: vLLM's ``stop_reason`` / SGLang's ``matched_stop``: the stop string or token id hit.
    stop_reason: int | str | None
    #: The engine's ``usage`` of the turn.
    usage: dict[str, Any] | None
    #: Prompt tokens served from the engine's prefix cache (when it reports them).
    cached_tokens: int | None
    timing: TurnTiming
    #: Sampling fields actually sent upstream (registered values, the per-turn seed...).
    sampling: dict[str, Any]
    #: Policy version in effect when the turn was sent upstream (``None``: never announced).
    policy_version: int | None
    #: Set when the policy version changed while the turn was being sampled: the
    #: version in effect when the answer came back.
    policy_version_end: int | None
    #: The engine's own weight version in its answer (SGLang ``metadata.weight_version``).
    engine_weight_version: str | None
    #: The prompt ids do not start with the previous turn's prompt + completion ids
    #: (re-tokenized history: a tool call re-rendered, a cut completion, ...).
    prefix_break: bool
    #: The previous turn's messages are not a prefix of this turn's request.
    history_rewritten: bool
    #: Why the step has ``tokens: null``.
    tokens_missing: str
    #: The engine sent token fields that could not be used (``tokens: null``).
    tokens_error: str
    #: Indexes of completion logprobs that are sentinels (e.g. ``-9999``) or not finite.
    logprob_sentinels: list[int]
    #: The other sampled choices of an ``n > 1`` request (same shape as the step's
    #: ``completion`` and ``tokens``), so no sampled token is dropped.
    other_choices: list[dict[str, Any]]
    #: Token-in upstream mode: the prompt ids were bridged onto the previous turn's
    #: prompt + completion ids (``False``: rendered from scratch).
    bridged: bool
    #: Token-in upstream mode: the renderer that tokenized the turn.
    renderer: str
    #: Token-in upstream mode: agent fields it cannot apply (``tool_choice``,
    #: ``parallel_tool_calls``, ``response_format``).
    not_applied: list[str]
    #: The ``tools`` of the agent's request (its tool definitions; ``[]``: none). In the
    #: delta form only on a step whose tools differ from the previous step's (the first
    #: step included); :func:`expand_delta_steps` carries them forward.
    tools: list[dict[str, Any]]


class PolicyVersionRequest(TypedDict):
    """Body of ``POST /v1/policy/version``: the trainer announces new weights."""

    version: int


class PolicyVersionResponse(TypedDict):
    """Answer of ``GET`` / ``POST /v1/policy/version``."""

    version: int | None
    #: Unix time of the last announcement (``None``: never announced).
    updated_at: float | None


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
    #: Our additions: the limit that refused a turn, turns whose answer reached nobody.
    truncation_reason: NotRequired[TruncationReason | None]
    abandoned_turns: NotRequired[int]
    #: Policy versions of the recorded turns, oldest first (reference gateway).
    policy_versions: NotRequired[list[int | None]]
    #: Engine calls that failed (the last 100), reference gateway.
    failed_turns: NotRequired[list[FailedTurn]]


#: ``GET /v1/rollouts/{id}/trajectory?format=delta``: the steps in the delta form (our
#: addition; without the parameter the answer is the protocol table's). The answer then
#: has ``"format": "delta"`` and each step, instead of ``prompt`` and ``tokens.prompt_ids``
#: / masks, holds ``prompt_shared`` (how many leading messages of the previous step's
#: prompt + completion it reuses), ``prompt_new`` (the messages after those), and in
#: ``tokens`` ``prompt_shared`` / ``prompt_new_ids`` (the same for token ids). Masks are
#: implied (prompt 0s, completion 1s). :func:`expand_delta_steps` rebuilds the full steps.
TRAJECTORY_DELTA_QUERY = {"format": "delta"}


def expand_delta_steps(steps: list[dict[str, Any]]) -> list[TrajectoryStepBody]:
    """Full trajectory steps (the protocol table's shape) from delta-form ``steps``."""
    out: list[TrajectoryStepBody] = []
    history: list[dict[str, Any]] = []
    history_ids: list[int] = []
    tools: Any = None
    for step in steps:
        extras = dict(step.get("extras") or {})
        if "tools" in extras:
            tools = extras["tools"]
        elif tools is not None:
            extras["tools"] = tools  # unchanged since the step that sent them
        prompt = [*history[: step["prompt_shared"]], *step["prompt_new"]]
        tokens: StepTokens | None = None
        delta = step.get("tokens")
        if delta is not None:
            prompt_ids = [*history_ids[: delta["prompt_shared"]], *delta["prompt_new_ids"]]
            completion_ids = delta["completion_ids"]
            tokens = {
                "prompt_ids": prompt_ids,
                "prompt_mask": [0] * len(prompt_ids),
                "completion_ids": completion_ids,
                "completion_mask": [1] * len(completion_ids),
                "completion_logprobs": delta["completion_logprobs"],
                "overlong_prompt": delta["overlong_prompt"],
                "is_truncated": delta["is_truncated"],
            }
            if delta.get("routed_experts") is not None:
                tokens["routed_experts"] = delta["routed_experts"]
            history_ids = [*prompt_ids, *completion_ids]
        else:
            history_ids = []
        history = [*prompt, *step["completion"]]
        out.append(
            {
                "prompt": prompt,
                "completion": step["completion"],
                "tokens": tokens,
                "reward": step.get("reward"),
                "advantage": step.get("advantage"),
                "is_truncated": step["is_truncated"],
                "trajectory_id": step["trajectory_id"],
                "extras": extras,
            }
        )
    return out


def delta_steps(steps: list[TrajectoryStepBody]) -> list[dict[str, Any]]:
    """The delta form of full ``steps`` (the inverse of :func:`expand_delta_steps`).

    For gateways (and fakes) that store full steps; each step's prompt is expressed
    against the previous step's prompt + completion, messages and token ids alike.
    """
    out: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    history_ids: list[int] = []
    tools: Any = None
    for step in steps:
        prompt = step["prompt"]
        shared = common_prefix_len(history, prompt)
        extras = dict(step.get("extras") or {})
        if "tools" in extras:
            if extras["tools"] == tools:
                del extras["tools"]  # as the previous step's: carried forward on expansion
            else:
                tools = extras["tools"]
        delta: dict[str, Any] | None = None
        tokens = step["tokens"]
        if tokens is not None:
            prompt_ids = tokens["prompt_ids"]
            shared_ids = common_prefix_len(history_ids, prompt_ids)
            delta = {
                "prompt_shared": shared_ids,
                "prompt_new_ids": prompt_ids[shared_ids:],
                "completion_ids": tokens["completion_ids"],
                "completion_logprobs": tokens["completion_logprobs"],
                "overlong_prompt": tokens["overlong_prompt"],
                "is_truncated": tokens["is_truncated"],
            }
            if tokens.get("routed_experts") is not None:
                delta["routed_experts"] = tokens["routed_experts"]
            history_ids = [*prompt_ids, *tokens["completion_ids"]]
        else:
            history_ids = []
        out.append(
            {
                "prompt_shared": shared,
                "prompt_new": prompt[shared:],
                "completion": step["completion"],
                "tokens": delta,
                "reward": step.get("reward"),
                "advantage": step.get("advantage"),
                "is_truncated": step["is_truncated"],
                "trajectory_id": step["trajectory_id"],
                "extras": extras,
            }
        )
        history = [*prompt, *step["completion"]]
    return out


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (lists, id arrays).

    Slice comparisons run in C: one when ``b`` extends ``a`` (the usual case), else a
    binary search over prefix lengths.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class StatusResponse(TypedDict):
    """Success body of cancel and unregister."""

    rollout_id: str
    status: str


__all__ = [
    "API_KEY_RE",
    "STATUS_ERROR_CODES",
    "error_code",
    "BEARER_CHAT_COMPLETIONS_PATH",
    "BEARER_MODELS_PATH",
    "CANCEL_ROUTE",
    "CHAT_COMPLETIONS_ROUTE",
    "EXITS_MAX_WAIT",
    "EXITS_PATH",
    "EXIT_ROUTE",
    "EXIT_STREAM_IDLE_TIMEOUT",
    "EXIT_STREAM_KEEPALIVE",
    "EXIT_STREAM_MAX_LINE",
    "EXIT_STREAM_MEDIA_TYPE",
    "IDEMPOTENCY_KEY_HEADER",
    "MODELS_ROUTE",
    "POLICY_VERSION_PATH",
    "REGISTER_ROUTE",
    "ROLLOUT_ID_RE",
    "ROLLOUT_PREFIX",
    "SDK_RETRY_COUNT_HEADER",
    "TRAJECTORY_DELTA_QUERY",
    "TRAJECTORY_ROUTE",
    "TURN_REFUSAL_CODES",
    "TURN_REFUSED_STATUS",
    "UNLIMITED_TURNS",
    "UNREGISTER_ROUTE",
    "ExitReport",
    "ExitStreamHeartbeat",
    "ExitStreamLine",
    "ExitsResponse",
    "FailedTurn",
    "PolicyVersionRequest",
    "PolicyVersionResponse",
    "RegisterRequest",
    "RegisterResponse",
    "RolloutStatus",
    "StatusResponse",
    "StepExtras",
    "StepTokens",
    "TrajectoryResponse",
    "TrajectoryStepBody",
    "TruncationReason",
    "TurnError",
    "TurnRefusalCode",
    "TurnTiming",
    "cancel_path",
    "chat_completions_path",
    "check_exit_stream_line",
    "common_prefix_len",
    "delta_steps",
    "exit_path",
    "exit_stream_line",
    "exits_query",
    "expand_delta_steps",
    "flatten_sampling_args",
    "gateway_host",
    "gateway_root",
    "is_valid_rollout_id",
    "new_rollout_api_key",
    "new_rollout_id",
    "parse_exit_stream_line",
    "parse_rollout_path",
    "register_path",
    "register_request",
    "register_response",
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

#: The ``truncation_reason`` values that are verifiers v1 limits (v1's own stop-condition
#: names): a v1 adapter makes the reported one the trace's stop condition.
LIMIT_STOP_CONDITIONS = ("max_turns", *TOKEN_LIMIT_FIELDS)


class TokenLimits(TypedDict, total=False):
    """Optional register fields: verifiers v1's token budgets for the rollout."""

    max_input_tokens: int
    max_output_tokens: int
    max_total_tokens: int


__all__ += ["LIMIT_STOP_CONDITIONS", "TOKEN_LIMIT_FIELDS", "TokenLimits"]
