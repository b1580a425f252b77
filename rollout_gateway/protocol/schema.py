"""The protocol's bodies (TypedDicts), and one ``parse_*`` per body that is read.

Each parser checks a body against its shape and returns it typed; the server parses the
requests it gets with them (a :class:`~.errors.BodyError` is its 400) and the client the
answers it gets (a :class:`~rollout_gateway.errors.GatewayProtocolError`), so both
sides refuse the same things. Checks are what a reader relies on, not every element of a
long list (a 32k context's ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict, cast

from rollout_gateway.protocol.errors import BodyError
from rollout_gateway.protocol.routes import API_KEY_RE

RolloutStatus = Literal["active", "completed", "cancelled"]

#: ``max_turns`` value meaning "no limit".
UNLIMITED_TURNS = -1

#: Token budgets of verifiers v1's ``RolloutLimits``, sent as extra register fields
#: (``{"max_input_tokens": int, ...}``); ``max_turns`` is the protocol's own field.
#: Counted as v1 counts them: input = new prompt tokens per turn (cache reads included),
#: output = completion tokens, total = both; soft by one turn (checked between turns).
TOKEN_LIMIT_FIELDS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")

#: The ``truncation_reason`` values that are verifiers v1 limits (v1's own stop-condition
#: names): a v1 adapter makes the reported one the trace's stop condition.
LIMIT_STOP_CONDITIONS = ("max_turns", *TOKEN_LIMIT_FIELDS)

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


class TokenLimits(TypedDict, total=False):
    """Optional register fields: verifiers v1's token budgets for the rollout."""

    max_input_tokens: int
    max_output_tokens: int
    max_total_tokens: int


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
    #: verifiers v1's token budgets (:class:`TokenLimits`).
    max_input_tokens: NotRequired[int]
    max_output_tokens: NotRequired[int]
    max_total_tokens: NotRequired[int]


class RegisterResponse(TypedDict):
    """Success body of register. ``api_key`` is our optional per-rollout credential."""

    rollout_id: str
    status: RolloutStatus
    model: str
    max_turns: int
    max_seq_len: int | None
    api_key: NotRequired[str]


class StatusResponse(TypedDict):
    """Success body of cancel and unregister."""

    rollout_id: str
    status: str


class PolicyVersionRequest(TypedDict):
    """Body of ``POST /v1/policy/version``: the trainer announces new weights."""

    version: int


class PolicyVersionResponse(TypedDict):
    """Answer of ``GET`` / ``POST /v1/policy/version``."""

    version: int | None
    #: Unix time of the last announcement (``None``: never announced).
    updated_at: float | None


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
    #: step included); :func:`~.delta.expand_delta_steps` carries them forward.
    tools: list[dict[str, Any]]
    #: The wire format the turn came in: ``"chat"`` (Chat Completions), ``"anthropic"``
    #: (Messages) or ``"responses"`` (Responses). Absent in steps recorded before it was.
    dialect: str
    #: The agent's own sampling fields as it sent them (not sent upstream: the
    #: registered sampling wins; ``sampling`` is what was sent).
    agent_sampling: dict[str, Any]
    #: Chat turns: the agent's fields the allowlist dropped (at most 32 names).
    dropped_fields: list[str]
    #: Messages and Responses turns: fields sent that mean nothing here (``metadata``,
    #: ``store``, ``include``...), by name.
    ignored_fields: list[str]
    #: Messages and Responses turns: tools the engine was not given (server or hosted
    #: tools: ``web_search``...).
    dropped_tools: list[str]
    #: Messages and Responses turns: content kinds the engine was not given.
    dropped_content: list[str]
    #: Responses turns: a ``tool_choice`` kind left to the engine (hosted tools,
    #: ``allowed_tools``).
    ignored_tool_choice: str


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


# -- building bodies ------------------------------------------------------------------


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


# -- reading bodies ---------------------------------------------------------------------


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise BodyError(f"{what} is not a JSON object")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: Mapping[str, Any], key: str, *, least: int, text: str) -> int | None:
    value = body.get(key)
    if value is not None and (not _is_int(value) or value < least):
        raise BodyError(f"'{key}' must be {text} or null")
    return value


def parse_register_request(data: Any) -> RegisterRequest:
    """A register body, checked: ``model`` a non-empty string, ``sampling_params`` an
    object (``{}`` when absent), ``max_turns`` an integer >= -1 (absent or null: no
    limit), ``max_seq_len`` and ``max_total_completion_tokens`` positive or null, a
    proposed ``api_key`` of 32-256 URL-safe characters, v1's token budgets
    (:data:`TOKEN_LIMIT_FIELDS`) non-negative or null. Returns the body with the fields
    it sets (other fields dropped). Raises :class:`~.errors.BodyError`."""
    body = _object(data, "the register body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BodyError("'model' must be a non-empty string")
    sampling = body.get("sampling_params")
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, dict):
        raise BodyError("'sampling_params' must be an object")
    max_turns = body.get("max_turns")
    max_turns = UNLIMITED_TURNS if max_turns is None else max_turns
    if not _is_int(max_turns) or max_turns < -1:
        raise BodyError("'max_turns' must be an integer >= -1")
    request: dict[str, Any] = {
        "model": model,
        "sampling_params": sampling,
        "max_turns": max_turns,
        "max_seq_len": _optional_int(body, "max_seq_len", least=1, text="a positive integer"),
    }
    completion = _optional_int(
        body, "max_total_completion_tokens", least=1, text="a positive integer"
    )
    if completion is not None:
        request["max_total_completion_tokens"] = completion
    api_key = body.get("api_key")
    if api_key is not None:
        if not isinstance(api_key, str) or not API_KEY_RE.fullmatch(api_key):
            raise BodyError("'api_key' must be 32-256 URL-safe characters")
        request["api_key"] = api_key
    for name in TOKEN_LIMIT_FIELDS:
        cap = _optional_int(body, name, least=0, text="a non-negative integer")
        if cap is not None:
            request[name] = cap
    return cast(RegisterRequest, request)


def parse_register_response(data: Any) -> RegisterResponse:
    """A register answer, checked (its ``api_key``, when there is one, a string).
    Raises :class:`~.errors.BodyError`."""
    answer = _object(data, "register answer")
    key = answer.get("api_key")
    if key is not None and not isinstance(key, str):
        raise BodyError("register answered a non-string api_key")
    return cast(RegisterResponse, answer)


def parse_status_response(data: Any) -> StatusResponse:
    """A cancel or unregister answer, checked. Raises :class:`~.errors.BodyError`."""
    return cast(StatusResponse, _object(data, "status answer"))


def parse_policy_version_request(data: Any) -> PolicyVersionRequest:
    """A policy announcement, checked: ``version`` a non-negative integer. Raises
    :class:`~.errors.BodyError`."""
    version = _object(data, "the policy body").get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise BodyError("'version' must be a non-negative integer")
    return {"version": version}


def parse_trajectory_response(data: Any) -> TrajectoryResponse:
    """A trajectory answer, checked: an object whose ``trajectory`` is a list of steps
    (in the delta form when ``format`` says ``"delta"``: see
    :func:`~.delta.expand_delta_steps`, which checks each). Raises
    :class:`~.errors.BodyError`."""
    answer = _object(data, "trajectory answer")
    steps = answer.get("trajectory")
    if steps is not None and not isinstance(steps, list):
        raise BodyError("trajectory answer: 'trajectory' is not a list")
    return cast(TrajectoryResponse, answer)


__all__ = [
    "LIMIT_STOP_CONDITIONS",
    "TOKEN_LIMIT_FIELDS",
    "UNLIMITED_TURNS",
    "FailedTurn",
    "PolicyVersionRequest",
    "PolicyVersionResponse",
    "RegisterRequest",
    "RegisterResponse",
    "RolloutStatus",
    "StatusResponse",
    "StepExtras",
    "StepTokens",
    "TokenLimits",
    "TrajectoryResponse",
    "TrajectoryStepBody",
    "TruncationReason",
    "TurnError",
    "TurnTiming",
    "flatten_sampling_args",
    "parse_policy_version_request",
    "parse_register_request",
    "parse_register_response",
    "parse_status_response",
    "parse_trajectory_response",
    "register_request",
    "register_response",
]
