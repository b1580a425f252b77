"""The gateway's Starlette app: protocol v1 routes, health and metrics.

See ``/work/shared/DESIGN.md`` (the gateway protocol table) for the contract; every route
answers errors as ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_gateway.exits import ExitBoard
from rollout_gateway.protocol import (
    API_KEY_RE,
    EXITS_MAX_WAIT,
    EXITS_PATH,
    UNLIMITED_TURNS,
    StatusResponse,
    TrajectoryResponse,
    is_valid_rollout_id,
    register_response,
)
from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.metrics import GatewayMetrics
from rollout_gateway.server.registry import (
    AlreadyRegisteredError,
    Clock,
    RegistryFullError,
    RolloutRecord,
    RolloutRegistry,
)
from rollout_gateway.server.responses import (
    ApiError,
    error_response,
    read_json_object,
    validate_messages,
)
from rollout_gateway.server.sse import iter_completion_sse
from rollout_gateway.server.turns import agent_view, build_upstream_request, read_turn
from rollout_gateway.server.upstream import UpstreamError, UpstreamPool

logger = logging.getLogger("rollout_gateway.server")

_CONTROL_BODY_LIMIT = 1024 * 1024  # register bodies are small


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token.strip()


def _token_matches(given: str | None, expected: str) -> bool:
    # Constant-time compare: no timing oracle on the secret's prefix.
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class Gateway:
    """The gateway's state and request handlers (one per app).

    Args:
        config: the settings.
        clock: monotonic clock of idle expiry (inject a fake one in tests).
        upstream_transport: httpx transport(s) to reach the upstreams (tests).
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        clock: Clock = time.monotonic,
        upstream_transport: httpx.AsyncBaseTransport
        | Mapping[str, httpx.AsyncBaseTransport]
        | None = None,
    ) -> None:
        self.config = config
        self.pool = UpstreamPool(
            config.upstreams,
            timeout_s=config.upstream_timeout_s,
            connect_timeout_s=config.upstream_connect_timeout_s,
            transport=upstream_transport,
            api_key=config.upstream_api_key,
            max_connections=config.max_connections_per_upstream,
        )
        self.metrics = GatewayMetrics(active_rollouts=lambda: len(self.registry))
        self.exit_board = ExitBoard()
        self.registry = RolloutRegistry(
            max_rollouts=config.max_rollouts,
            ttl_s=config.rollout_ttl_s,
            clock=clock,
            on_remove=self._on_remove,
            on_expire=self._on_expire,
        )

    def _on_remove(self, record: RolloutRecord) -> None:
        self.pool.release(record.upstream)
        self.exit_board.forget(record.rollout_id)

    def _on_expire(self, record: RolloutRecord) -> None:
        self.metrics.expired_rollouts.inc()
        logger.info("rollout=%s expired after %.0f s idle", record.rollout_id, self.registry.ttl_s)

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _rollout_id(request: Request) -> str:
        rollout_id = request.path_params["rollout_id"]
        if not is_valid_rollout_id(rollout_id):
            raise ApiError(
                400, "invalid rollout id (expected [A-Za-z0-9_-]{1,128})", "invalid_rollout_id"
            )
        return rollout_id

    def _check_admin(self, request: Request) -> None:
        token = self.config.admin_token
        if token and not _token_matches(_bearer(request), token):
            raise ApiError(401, "missing or invalid admin token", "unauthorized")

    def _record(self, rollout_id: str) -> RolloutRecord:
        record = self.registry.get(rollout_id)
        if record is None:
            raise ApiError(404, f"rollout {rollout_id} is not registered", "rollout_not_found")
        return record

    # -- control plane -------------------------------------------------------------------

    async def register(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/register``."""
        rollout_id = self._rollout_id(request)
        self._check_admin(request)
        if not self.config.enabled:
            raise ApiError(503, "the rollout gateway is disabled", "gateway_disabled")
        body = await read_json_object(request, _CONTROL_BODY_LIMIT)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' must be a non-empty string", "invalid_request_error")
        sampling = body.get("sampling_params")
        sampling = {} if sampling is None else sampling
        if not isinstance(sampling, dict):
            raise ApiError(400, "'sampling_params' must be an object", "invalid_request_error")
        max_turns = body.get("max_turns", UNLIMITED_TURNS)
        if max_turns is None:
            max_turns = UNLIMITED_TURNS
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < -1:
            raise ApiError(400, "'max_turns' must be an integer >= -1", "invalid_request_error")
        max_seq_len = body.get("max_seq_len")
        if max_seq_len is not None and (
            isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1
        ):
            raise ApiError(
                400, "'max_seq_len' must be a positive integer or null", "invalid_request_error"
            )
        proposed_key = body.get("api_key")
        if proposed_key is not None and (
            not isinstance(proposed_key, str) or not API_KEY_RE.fullmatch(proposed_key)
        ):
            raise ApiError(
                400, "'api_key' must be 32-256 URL-safe characters", "invalid_request_error"
            )
        if self.registry.get(rollout_id) is not None:
            raise ApiError(409, f"rollout {rollout_id} is already registered", "conflict")

        upstream = self.pool.pin()
        record = RolloutRecord(
            rollout_id=rollout_id,
            model=model,
            sampling_params=sampling,
            max_turns=max_turns,
            max_seq_len=max_seq_len,
            upstream=upstream.base_url,
            last_activity=self.registry.clock(),
            # The env's proposed key, so it knows the key even if this answer is lost.
            api_key=(proposed_key or secrets.token_urlsafe(32))
            if self.config.require_rollout_keys
            else None,
        )
        try:
            self.registry.add(record)
        except AlreadyRegisteredError:
            self.pool.release(upstream.base_url)
            raise ApiError(409, f"rollout {rollout_id} is already registered", "conflict") from None
        except RegistryFullError as exc:
            self.pool.release(upstream.base_url)
            raise ApiError(503, str(exc), "registry_full") from None
        self.metrics.registrations.inc()
        logger.info("rollout=%s registered upstream=%s", rollout_id, upstream.base_url)
        answer = register_response(
            rollout_id,
            {
                "model": model,
                "sampling_params": sampling,
                "max_turns": max_turns,
                "max_seq_len": max_seq_len,
            },
            api_key=record.api_key,
        )
        return JSONResponse(answer)

    async def trajectory(self, request: Request) -> Response:
        """``GET /v1/rollouts/{id}/trajectory``."""
        rollout_id = self._rollout_id(request)
        self._check_admin(request)
        record = self._record(rollout_id)
        self.registry.touch(record)
        steps = record.recorder.steps()
        prompt, completion, truncated = record.recorder.summary(steps)
        answer: TrajectoryResponse = {
            "rollout_id": rollout_id,
            "status": record.status,
            "num_turns": record.num_turns,
            "model": record.model,
            "prompt": prompt,
            "completion": completion,
            "is_truncated": truncated,
            "trajectory": steps,
        }
        return JSONResponse(answer)

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/cancel``: later chat calls get 409."""
        rollout_id = self._rollout_id(request)
        self._check_admin(request)
        record = self._record(rollout_id)
        record.status = "cancelled"  # no lock: must not wait for a turn in flight
        self.registry.touch(record)
        logger.info("rollout=%s cancelled", rollout_id)
        answer: StatusResponse = {"rollout_id": rollout_id, "status": "cancelled"}
        return JSONResponse(answer)

    async def unregister(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/unregister``: forget the rollout and its trajectory."""
        rollout_id = self._rollout_id(request)
        self._check_admin(request)
        record = self.registry.remove(rollout_id)
        if record is None:
            raise ApiError(404, f"rollout {rollout_id} is not registered", "rollout_not_found")
        logger.info("rollout=%s unregistered turns=%d", rollout_id, record.num_turns)
        answer: StatusResponse = {"rollout_id": rollout_id, "status": record.status}
        return JSONResponse(answer)

    async def exits(self, request: Request) -> Response:
        """``GET /v1/rollouts/exits?after=<seq>&timeout=<s>``: agent exit reports, long-polled."""
        self._check_admin(request)
        try:
            after = int(request.query_params.get("after", "0"))
            timeout = float(request.query_params.get("timeout", "0"))
        except ValueError:
            raise ApiError(
                400, "'after' and 'timeout' must be numbers", "invalid_request_error"
            ) from None
        if not math.isfinite(timeout) or timeout < 0:
            raise ApiError(400, "'timeout' must be a non-negative number", "invalid_request_error")
        answer = await self.exit_board.wait(after, min(timeout, EXITS_MAX_WAIT))
        return JSONResponse(answer)

    # -- data plane ----------------------------------------------------------------------

    async def report_exit(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/exit``: the agent's launch wrapper reports its exit."""
        rollout_id = self._rollout_id(request)
        record = self._record(rollout_id)
        if record.api_key is not None and not _token_matches(_bearer(request), record.api_key):
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        body = await read_json_object(request, _CONTROL_BODY_LIMIT)
        exit_code = body.get("exit_code")
        if exit_code is not None and (
            isinstance(exit_code, bool) or not isinstance(exit_code, int)
        ):
            raise ApiError(400, "'exit_code' must be an integer or null", "invalid_request_error")
        self.exit_board.report(rollout_id, exit_code)
        return JSONResponse({"rollout_id": rollout_id, "status": "exit_reported"})

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/chat/completions``: forward, record, answer."""
        start = time.perf_counter()
        rollout_id = self._rollout_id(request)
        record = self._record(rollout_id)
        if record.api_key is not None and not _token_matches(_bearer(request), record.api_key):
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        body = await read_json_object(request, self.config.max_body_bytes)
        messages = validate_messages(body)

        async with record.lock:  # turns of one rollout run one at a time, in order
            if not record.live:
                raise ApiError(404, f"rollout {rollout_id} is not registered", "rollout_not_found")
            if record.status == "cancelled":
                raise ApiError(409, f"rollout {rollout_id} is cancelled", "conflict")
            if record.status == "completed" or record.at_max_turns:
                raise ApiError(
                    409,
                    f"rollout {rollout_id} is completed (max_turns={record.max_turns})",
                    "conflict",
                )
            self.registry.touch(record)
            upstream_body = build_upstream_request(
                body, model=record.model, sampling_params=record.sampling_params
            )
            try:
                completion, upstream_s = await self.pool.chat(record.upstream, upstream_body)
            except UpstreamError as exc:
                self.metrics.upstream_errors.inc(record.upstream, exc.kind)
                self.registry.touch(record)
                logger.warning(
                    "rollout=%s turn=%d upstream=%s error=%s: %s",
                    rollout_id,
                    record.num_turns + 1,
                    record.upstream,
                    exc.kind,
                    exc.message,
                )
                raise ApiError(exc.status_code, exc.message, "upstream_error") from None
            turn = read_turn(completion)
            record.recorder.record(
                messages,
                turn.completion,
                prompt_ids=turn.prompt_ids,
                completion_ids=turn.completion_ids,
                completion_logprobs=turn.completion_logprobs,
                finish_reason=turn.finish_reason,
                total_tokens=turn.total_tokens,
            )
            record.num_turns += 1
            turn_number = record.num_turns
            if record.at_max_turns and record.status == "active":
                record.status = "completed"
            self.registry.touch(record)

        self.metrics.turns.inc(record.upstream)
        self.metrics.upstream_latency.observe(upstream_s, record.upstream)
        logger.info(
            "rollout=%s turn=%d latency_ms=%.1f upstream_ms=%.1f finish=%s",
            rollout_id,
            turn_number,
            (time.perf_counter() - start) * 1000,
            upstream_s * 1000,
            turn.finish_reason,
        )
        answer = agent_view(completion, body)
        if body.get("stream"):
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return StreamingResponse(
                iter_completion_sse(answer, include_usage=include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(answer)

    async def models(self, request: Request) -> Response:
        """``GET /v1/rollouts/{id}/models``: the registered model, for agents that list models.

        Not part of protocol v1; agents whose SDK probes ``{base_url}/models`` at start
        would otherwise get a 404.
        """
        rollout_id = self._rollout_id(request)
        record = self._record(rollout_id)
        if record.api_key is not None and not _token_matches(_bearer(request), record.api_key):
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        card = {"id": record.model, "object": "model", "created": 0, "owned_by": "rollout-gateway"}
        return JSONResponse({"object": "list", "data": [card]})

    # -- operations ----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """``GET /health``: liveness plus upstream states."""
        return JSONResponse(
            {
                "status": "ok",
                "enabled": self.config.enabled,
                "active_rollouts": len(self.registry),
                "upstreams": self.pool.describe(),
            }
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text."""
        return PlainTextResponse(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def sweep(self) -> int:
        """Expire idle rollouts now; returns how many were dropped."""
        return len(self.registry.expire_idle())

    async def _periodic(self, interval_s: float, action: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                result = action()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # a failed sweep must not kill the loop
                logger.exception("periodic task failed")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Run the idle sweep and the upstream re-probe; close pools at shutdown."""
        tasks = [
            asyncio.create_task(self._periodic(self.config.sweep_interval_s, self.sweep)),
            asyncio.create_task(
                self._periodic(self.config.probe_interval_s, self.pool.probe_unhealthy)
            ),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.pool.aclose()

    # -- error rendering -----------------------------------------------------------------

    async def _on_api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        self.metrics.rejected_requests.inc(str(exc.status_code))
        return error_response(exc.status_code, exc.message, exc.error_type)

    async def _on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error_type = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), error_type)

    async def _on_unexpected(self, request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(500, f"internal gateway error: {exc!r}", "internal_error")


def create_app(
    config: GatewayConfig,
    *,
    clock: Clock = time.monotonic,
    upstream_transport: httpx.AsyncBaseTransport
    | Mapping[str, httpx.AsyncBaseTransport]
    | None = None,
) -> Starlette:
    """The gateway ASGI app. Its state is ``app.state.gateway`` (a :class:`Gateway`).

    Args:
        config: the settings.
        clock: monotonic clock used for idle expiry (tests inject a fake one).
        upstream_transport: httpx transport for the upstreams, or one per upstream URL
            (tests route to in-process apps with ``httpx.ASGITransport``).
    """
    gateway = Gateway(config, clock=clock, upstream_transport=upstream_transport)
    prefix = "/v1/rollouts/{rollout_id}"
    app = Starlette(
        routes=[
            Route(EXITS_PATH, gateway.exits, methods=["GET"]),
            Route(f"{prefix}/register", gateway.register, methods=["POST"]),
            Route(f"{prefix}/exit", gateway.report_exit, methods=["POST"]),
            Route(f"{prefix}/chat/completions", gateway.chat_completions, methods=["POST"]),
            Route(f"{prefix}/trajectory", gateway.trajectory, methods=["GET"]),
            Route(f"{prefix}/cancel", gateway.cancel, methods=["POST"]),
            Route(f"{prefix}/unregister", gateway.unregister, methods=["POST"]),
            Route(f"{prefix}/models", gateway.models, methods=["GET"]),
            Route("/health", gateway.health, methods=["GET"]),
            Route("/metrics", gateway.metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: gateway._on_api_error,
            HTTPException: gateway._on_http_error,
            Exception: gateway._on_unexpected,
        },
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    return app


__all__ = ["Gateway", "create_app"]
