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
    EXITS_MAX_WAIT,
    UNLIMITED_TURNS,
    FailedTurn,
    PolicyVersionResponse,
    RegisterRequest,
    StatusResponse,
    TrajectoryResponse,
    parse_policy_version_request,
    parse_register_request,
    register_response,
)
from rollout_gateway.protocol.errors import BodyError
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
from rollout_gateway.server.state.limits_v1 import TokenBudget
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


def _check_sampling(sampling: Mapping[str, Any]) -> None:
    """Register's ``sampling_params`` may not set the conversation (registered fields
    override the agent's request; see
    :data:`~rollout_gateway.server.engines.upstream_request.NOT_REGISTRABLE_FIELDS`)."""
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
        value = flat.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ApiError(
                400,
                f"'sampling_params.{key}' must be a positive integer or null",
                "invalid_request_error",
            )


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
        try:
            body = parse_register_request(await read_json_object(request, CONTROL_BODY_LIMIT))
        except BodyError as exc:
            raise ApiError(400, str(exc), "invalid_request_error") from None
        _check_sampling(body["sampling_params"])
        if await self.gateway.rollouts.find(rollout_id) is not None:
            raise ApiError(409, f"rollout {rollout_id} is already registered", "conflict")
        upstream = self.gateway.pool.pin()
        try:
            record, api_key = await self._new_record(rollout_id, body, upstream.base_url)
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
        answered: RegisterRequest = {
            "model": body["model"],
            "sampling_params": body["sampling_params"],
            "max_turns": body["max_turns"],
            "max_seq_len": record.max_seq_len,
        }
        return JSONBytesResponse(register_response(rollout_id, answered, api_key=api_key))

    async def _new_record(
        self, rollout_id: str, body: RegisterRequest, upstream: str
    ) -> tuple[RolloutRecord, str | None]:
        """The record of a rollout registered with ``body``, pinned to ``upstream`` (the
        gateway's defaults where the body sets none), and its key (``None``: keys off)."""
        config = self.gateway.config
        clock = self.gateway.registry.clock
        max_seq_len = body["max_seq_len"]
        if max_seq_len is None and config.limits.default_max_context_tokens is None:
            # Default: the context length the engine serves (its /models max_model_len).
            max_seq_len = (await self.gateway.engine(upstream)).max_model_len
        # The env's proposed key, so it knows the key even if this answer is lost.
        api_key = None
        if config.require_rollout_keys:
            api_key = body.get("api_key") or secrets.token_urlsafe(32)
        max_turns = body["max_turns"]
        max_completion = body.get("max_total_completion_tokens")
        record = RolloutRecord(
            rollout_id=rollout_id,
            model=body["model"],
            sampling_params=body["sampling_params"],
            # The gateway's default turn budget stands in for "no limit".
            max_turns=config.limits.default_max_turns
            if max_turns == UNLIMITED_TURNS
            else max_turns,
            max_seq_len=max_seq_len,
            upstream=upstream,
            last_activity=clock(),
            key_digest=key_digest(api_key) if api_key is not None else None,
            max_total_completion_tokens=min(
                max_completion or config.limits.max_total_completion_tokens,
                config.limits.max_total_completion_tokens,
            ),
            max_context_tokens=max_seq_len or config.limits.default_max_context_tokens,
            max_message_bytes=config.limits.max_rollout_message_bytes,
            turns=TurnTracker(config.limits.retry_dedupe_window_s, clock),
            token_budget=TokenBudget.from_limits(body),
        )
        return record, api_key

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
        await self.gateway.ledger.cancel(record)
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
        await self.gateway.coordinator.refresh_policy()  # (announced at another gateway)
        return self._policy_answer()

    async def set_policy_version(self, request: Request) -> Response:
        """``POST /v1/policy/version`` ``{"version": int}``: the trainer loaded new weights.

        Turns sent upstream from now on are stamped with it; a turn under way keeps the
        version it started with and gets ``policy_version_end`` when it ends.
        """
        self.gateway.check_admin(request)
        try:
            body = parse_policy_version_request(await read_json_object(request, CONTROL_BODY_LIMIT))
        except BodyError as exc:
            raise ApiError(400, str(exc), "invalid_request_error") from None
        version = body["version"]
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
