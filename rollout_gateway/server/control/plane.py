"""The gateway's control plane: the env's and the trainer's routes (admin token).

Register, trajectory, cancel and unregister of a rollout, the agents' exit reports
(long-poll and stream, see :mod:`rollout_gateway.exits`) and the policy version. The
agents' own routes (chat, models, exit report) are the data plane, in
:mod:`rollout_gateway.server.agents`.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from starlette.requests import Request
from starlette.responses import Response

from rollout_gateway.protocol import (
    API_KEY_RE,
    EXITS_MAX_WAIT,
    UNLIMITED_TURNS,
    FailedTurn,
    PolicyVersionResponse,
    RegisterRequest,
    StatusResponse,
    TrajectoryResponse,
    register_response,
)
from rollout_gateway.server.engines.upstream_request import (
    NOT_REGISTRABLE_FIELDS,
    flatten_sampling_params,
)
from rollout_gateway.server.http.jsonio import JSONBytesResponse
from rollout_gateway.server.http.responses import (
    CONTROL_BODY_LIMIT,
    ApiError,
    checked_rollout_id,
    read_json_object,
)
from rollout_gateway.server.state.dedupe import TurnTracker
from rollout_gateway.server.state.limits_v1 import LimitsError, TokenBudget
from rollout_gateway.server.state.policy import StaleVersionError
from rollout_gateway.server.state.registry import (
    AlreadyRegisteredError,
    RegistryFullError,
    RolloutRecord,
    key_digest,
)

if TYPE_CHECKING:
    from rollout_gateway.server.context import GatewayContext
    from rollout_gateway.server.control.exit_stream import ExitStreams

logger = logging.getLogger("rollout_gateway.server")


def _rollout_id(request: Request) -> str:
    return checked_rollout_id(request.path_params["rollout_id"])


def _sampling_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """Register's ``sampling_params``: an object (``{}`` when absent) that does not set the
    conversation (registered fields override the agent's request; see
    :data:`~rollout_gateway.server.engines.upstream_request.NOT_REGISTRABLE_FIELDS`)."""
    sampling = body.get("sampling_params")
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, dict):
        raise ApiError(400, "'sampling_params' must be an object", "invalid_request_error")
    flat = flatten_sampling_params(sampling)
    conversation = [k for k in NOT_REGISTRABLE_FIELDS if k in flat]
    if conversation:
        raise ApiError(
            400,
            f"'sampling_params' may not set {', '.join(conversation)}: the conversation "
            "is the agent's",
            "invalid_request_error",
        )
    for key in ("max_tokens", "max_completion_tokens"):  # what every turn sends upstream
        _optional_positive_int(flat, key, f"sampling_params.{key}")
    return sampling


def _optional_positive_int(
    body: Mapping[str, Any], key: str, name: str | None = None
) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ApiError(
            400, f"'{name or key}' must be a positive integer or null", "invalid_request_error"
        )
    return value


class ControlPlane:
    """The control-plane route handlers of one gateway.

    Args:
        gateway: the gateway (its settings and state).
        exit_streams: its open exit streams (``GET`` :data:`~rollout_gateway.protocol.EXITS_PATH`
            with ``stream=1``).
    """

    def __init__(self, gateway: GatewayContext, exit_streams: ExitStreams) -> None:
        self.gateway = gateway
        self.exit_streams = exit_streams

    async def register(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/register``."""
        rollout_id = _rollout_id(request)
        self.gateway.check_admin(request)
        if not self.gateway.config.enabled:
            raise ApiError(503, "the rollout gateway is disabled", "gateway_disabled")
        body = await read_json_object(request, CONTROL_BODY_LIMIT)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' must be a non-empty string", "invalid_request_error")
        sampling = _sampling_params(body)
        max_turns = body.get("max_turns", UNLIMITED_TURNS)
        if max_turns is None:
            max_turns = UNLIMITED_TURNS
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < -1:
            raise ApiError(400, "'max_turns' must be an integer >= -1", "invalid_request_error")
        max_seq_len = _optional_positive_int(body, "max_seq_len")
        max_completion = _optional_positive_int(body, "max_total_completion_tokens")
        proposed_key = body.get("api_key")
        if proposed_key is not None and (
            not isinstance(proposed_key, str) or not API_KEY_RE.fullmatch(proposed_key)
        ):
            raise ApiError(
                400, "'api_key' must be 32-256 URL-safe characters", "invalid_request_error"
            )
        try:
            token_budget = TokenBudget.from_register(body)
        except LimitsError as exc:
            raise ApiError(400, str(exc), "invalid_request_error") from None
        if await self.gateway.rollouts.find(rollout_id) is not None:
            raise ApiError(409, f"rollout {rollout_id} is already registered", "conflict")

        config = self.gateway.config
        upstream = self.gateway.pool.pin()
        if max_seq_len is None and config.limits.default_max_context_tokens is None:
            # Default: the context length the engine serves (its /models max_model_len).
            max_seq_len = (await self.gateway.engine(upstream.base_url)).max_model_len
        # The env's proposed key, so it knows the key even if this answer is lost.
        api_key = None
        if config.require_rollout_keys:
            api_key = proposed_key or secrets.token_urlsafe(32)
        record = RolloutRecord(
            rollout_id=rollout_id,
            model=model,
            sampling_params=sampling,
            # The gateway's default turn budget stands in for "no limit".
            max_turns=config.limits.default_max_turns
            if max_turns == UNLIMITED_TURNS
            else max_turns,
            max_seq_len=max_seq_len,
            upstream=upstream.base_url,
            last_activity=self.gateway.registry.clock(),
            key_digest=key_digest(api_key) if api_key is not None else None,
            max_total_completion_tokens=min(
                max_completion or config.limits.max_total_completion_tokens,
                config.limits.max_total_completion_tokens,
            ),
            max_context_tokens=max_seq_len or config.limits.default_max_context_tokens,
            max_message_bytes=config.limits.max_rollout_message_bytes,
            turns=TurnTracker(config.limits.retry_dedupe_window_s, self.gateway.registry.clock),
            token_budget=token_budget,
        )
        try:
            await self.gateway.rollouts.register(record)
        except AlreadyRegisteredError:
            self.gateway.pool.release(upstream.base_url)
            raise ApiError(409, f"rollout {rollout_id} is already registered", "conflict") from None
        except RegistryFullError as exc:
            self.gateway.pool.release(upstream.base_url)
            raise ApiError(503, str(exc), "registry_full") from None
        except BaseException:  # the store failed (503): nothing was registered
            self.gateway.pool.release(upstream.base_url)
            raise
        self.gateway.metrics.registrations.inc()
        logger.info("rollout=%s registered upstream=%s", rollout_id, upstream.label)
        request_body: RegisterRequest = {
            "model": model,
            "sampling_params": sampling,
            "max_turns": max_turns,
            "max_seq_len": max_seq_len,
        }
        answer = register_response(rollout_id, request_body, api_key=api_key)
        return JSONBytesResponse(answer)

    async def trajectory(self, request: Request) -> Response:
        """``GET /v1/rollouts/{id}/trajectory``."""
        rollout_id = _rollout_id(request)
        self.gateway.check_admin(request)
        record = await self.gateway.rollouts.current(await self.gateway.record(rollout_id))
        self.gateway.registry.touch(record)
        prompt, completion, truncated = record.recorder.overview()
        delta = request.query_params.get("format") == "delta"
        steps: Any = record.recorder.delta_steps() if delta else record.recorder.steps()
        answer: TrajectoryResponse = {
            "rollout_id": rollout_id,
            "status": record.status,
            "num_turns": record.num_turns,
            "model": record.model,
            "prompt": prompt,
            "completion": completion,
            "is_truncated": truncated or record.truncation_reason is not None,
            "trajectory": steps,
            "truncation_reason": record.truncation_reason,
            "abandoned_turns": record.recorder.num_abandoned,
            "policy_versions": [s["extras"].get("policy_version") for s in steps],
            "failed_turns": cast(list[FailedTurn], list(record.failed_turns)),
        }
        if delta:
            answer["format"] = "delta"  # type: ignore[typeddict-unknown-key]
        return JSONBytesResponse(answer)

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/cancel``: later chat calls are refused."""
        rollout_id = _rollout_id(request)
        self.gateway.check_admin(request)
        record = await self.gateway.record(rollout_id)
        # No lock: must not wait for a turn in flight (a turn's later writes keep it).
        await self.gateway.rollouts.cancel(record)
        self.gateway.registry.touch(record)
        logger.info("rollout=%s cancelled", rollout_id)
        answer: StatusResponse = {"rollout_id": rollout_id, "status": "cancelled"}
        return JSONBytesResponse(answer)

    async def unregister(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/unregister``: forget the rollout and its trajectory."""
        rollout_id = _rollout_id(request)
        self.gateway.check_admin(request)
        record = await self.gateway.rollouts.unregister(rollout_id)
        if record is None:
            raise ApiError(
                404, f"rollout {rollout_id} is not registered", "not_found",
                code="rollout_not_found",
            )  # fmt: skip
        self.gateway.exit_board.forget(rollout_id)  # (a shared store's board keeps it till now)
        logger.info("rollout=%s unregistered turns=%d", rollout_id, record.num_turns)
        answer: StatusResponse = {"rollout_id": rollout_id, "status": record.status}
        return JSONBytesResponse(answer)

    async def exits(self, request: Request) -> Response:
        """``GET /v1/rollouts/exits?after=<seq>&timeout=<s>``: agent exit reports, long-polled.

        With ``stream=1`` (and no ``timeout``), the exit stream instead (see
        :mod:`rollout_gateway.server.control.exit_stream`).
        """
        self.gateway.check_admin(request)
        if request.query_params.get("stream") == "1":
            try:
                after = int(request.query_params.get("after", "0"))
            except ValueError:
                raise ApiError(400, "'after' must be an integer", "invalid_request_error") from None
            return self.exit_streams.response(after)
        try:
            after = int(request.query_params.get("after", "0"))
            timeout = float(request.query_params.get("timeout", "0"))
        except ValueError:
            raise ApiError(
                400, "'after' and 'timeout' must be numbers", "invalid_request_error"
            ) from None
        if not math.isfinite(timeout) or timeout < 0:
            raise ApiError(400, "'timeout' must be a non-negative number", "invalid_request_error")
        answer = await self.gateway.exit_board.wait(after, min(timeout, EXITS_MAX_WAIT))
        return JSONBytesResponse(answer)

    def _policy_answer(self) -> Response:
        answer: PolicyVersionResponse = {
            "version": self.gateway.policy.version,
            "updated_at": self.gateway.policy.updated_at,
        }
        return JSONBytesResponse(answer)

    async def get_policy_version(self, request: Request) -> Response:
        """``GET /v1/policy/version``: the version new turns are stamped with."""
        self.gateway.check_admin(request)
        if self.gateway.store.shared:  # announced at any gateway: ask the store
            self.gateway.policy_announced(await self.gateway.store.load_policy())
        return self._policy_answer()

    async def set_policy_version(self, request: Request) -> Response:
        """``POST /v1/policy/version`` ``{"version": int}``: the trainer loaded new weights.

        Turns sent upstream from now on are stamped with it; a turn under way keeps the
        version it started with and gets ``policy_version_end`` when it ends.
        """
        self.gateway.check_admin(request)
        body = await read_json_object(request, CONTROL_BODY_LIMIT)
        version = body.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ApiError(400, "'version' must be a non-negative integer", "invalid_request_error")
        policy = self.gateway.policy
        try:
            policy.check(version)
        except StaleVersionError as exc:
            raise ApiError(409, str(exc), "conflict") from None
        state = await self.gateway.store.announce_policy(version, policy.wall_clock())
        assert state.version is not None
        policy.adopt(state.version, state.updated_at)
        if state.version != version:  # another gateway announced a newer one meanwhile
            raise ApiError(
                409,
                f"policy version {version} is older than the version in effect ({state.version})",
                "conflict",
            )
        logger.info("policy version %d announced", version)
        return self._policy_answer()


__all__ = ["ControlPlane"]
