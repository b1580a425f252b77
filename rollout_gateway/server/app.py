"""The gateway's Starlette app: protocol v1 routes, health and metrics.

See ``/work/shared/DESIGN.md`` (the gateway protocol table) for the contract; every route
answers errors as ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout_gateway.protocol import (
    POLICY_VERSION_PATH,
    UNLIMITED_TURNS,
    PolicyVersionResponse,
    RegisterResponse,
    StatusResponse,
    TrajectoryResponse,
    is_valid_rollout_id,
)
from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.engines import EngineInfo, probe_engine
from rollout_gateway.server.metrics import GatewayMetrics
from rollout_gateway.server.policy import PolicyClock, StaleVersionError
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
from rollout_gateway.server.turn_runner import Turn, TurnRunner, prepare_upstream_body
from rollout_gateway.server.turns import build_upstream_request
from rollout_gateway.server.upstream import UpstreamPool

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
        self.registry = RolloutRegistry(
            max_rollouts=config.max_rollouts,
            ttl_s=config.rollout_ttl_s,
            clock=clock,
            on_remove=lambda r: self.pool.release(r.upstream),
            on_expire=self._on_expire,
        )
        #: The policy version in effect (announced by the trainer).
        self.policy = PolicyClock()
        #: What runs behind each upstream (probed at start-up and on first use).
        self.engines = {url: EngineInfo() for url in config.upstreams}
        self.turns = TurnRunner(
            self.pool,
            self.registry,
            self.metrics,
            self.policy,
            keepalive_s=config.stream_keepalive_s,
        )

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

    async def _engine(self, url: str) -> EngineInfo:
        """The engine behind ``url``, probed now if the start-up probe found it down."""
        info = self.engines[url]
        if not info.probed:
            await probe_engine(self.pool.get(url).client, info)
        return info

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
        if self.registry.get(rollout_id) is not None:
            raise ApiError(409, f"rollout {rollout_id} is already registered", "conflict")

        upstream = self.pool.pin()
        if max_seq_len is None:  # default: the context length the engine serves
            max_seq_len = (await self._engine(upstream.base_url)).max_model_len
        record = RolloutRecord(
            rollout_id=rollout_id,
            model=model,
            sampling_params=sampling,
            max_turns=max_turns,
            max_seq_len=max_seq_len,
            upstream=upstream.base_url,
            last_activity=self.registry.clock(),
            api_key=secrets.token_urlsafe(32) if self.config.require_rollout_keys else None,
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
        answer: RegisterResponse = {
            "rollout_id": rollout_id,
            "status": "active",
            "model": model,
            "max_turns": max_turns,
            "max_seq_len": max_seq_len,
        }
        if record.api_key is not None:
            answer["api_key"] = record.api_key
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
            "truncated_reason": record.truncated_reason,
            "policy_versions": [s["extras"].get("policy_version") for s in steps],
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

    # -- data plane ----------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/chat/completions``: forward, record, answer."""
        rollout_id = self._rollout_id(request)
        record = self._record(rollout_id)
        if record.api_key is not None and not _token_matches(_bearer(request), record.api_key):
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        body = await read_json_object(request, self.config.max_body_bytes)
        messages = validate_messages(body)

        await record.lock.acquire()  # turns of one rollout run one at a time, in order
        try:
            if not record.live:
                raise ApiError(404, f"rollout {rollout_id} is not registered", "rollout_not_found")
            if record.status == "cancelled":
                raise ApiError(409, f"rollout {rollout_id} is cancelled", "conflict")
            if record.status == "completed" or record.at_max_turns:
                reason = record.truncated_reason or f"max_turns={record.max_turns}"
                raise ApiError(409, f"rollout {rollout_id} is completed ({reason})", "conflict")
            self.registry.touch(record)
            engine = await self._engine(record.upstream)
            upstream_body = build_upstream_request(
                body, model=record.model, sampling_params=record.sampling_params
            )
            turn = Turn(
                record=record,
                body=body,
                messages=messages,
                upstream_body=prepare_upstream_body(upstream_body, record, engine),
                engine=engine,
                policy_version=self.policy.version,
                policy_epoch=self.policy.epoch,
            )
        except BaseException:
            record.lock.release()
            raise
        return await self.turns.respond(turn)  # releases the lock when the turn is over

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

    # -- policy version ------------------------------------------------------------------

    def _policy_answer(self) -> Response:
        answer: PolicyVersionResponse = {
            "version": self.policy.version,
            "updated_at": self.policy.updated_at,
        }
        return JSONResponse(answer)

    async def get_policy_version(self, request: Request) -> Response:
        """``GET /v1/policy/version``: the version turns are stamped with now."""
        self._check_admin(request)
        return self._policy_answer()

    async def set_policy_version(self, request: Request) -> Response:
        """``POST /v1/policy/version`` ``{"version": int}``: the trainer loaded new weights.

        Turns sent upstream from now on are stamped with it; a turn under way keeps the
        version it started with and is flagged ``policy_version_end`` when it ends.
        """
        self._check_admin(request)
        body = await read_json_object(request, _CONTROL_BODY_LIMIT)
        version = body.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ApiError(400, "'version' must be a non-negative integer", "invalid_request_error")
        try:
            self.policy.announce(version)
        except StaleVersionError as exc:
            raise ApiError(409, str(exc), "conflict") from None
        logger.info("policy version %d announced", version)
        return self._policy_answer()

    # -- operations ----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """``GET /health``: liveness plus upstream states."""
        return JSONResponse(
            {
                "status": "ok",
                "enabled": self.config.enabled,
                "active_rollouts": len(self.registry),
                "upstreams": [
                    {**state, **self.engines[state["url"]].describe()}
                    for state in self.pool.describe()
                ],
                "policy_version": self.policy.version,
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
        """Probe the engines; run the idle sweep and the upstream re-probe; close pools."""
        await asyncio.gather(
            *(probe_engine(self.pool.get(url).client, info) for url, info in self.engines.items())
        )
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
            Route(f"{prefix}/register", gateway.register, methods=["POST"]),
            Route(f"{prefix}/chat/completions", gateway.chat_completions, methods=["POST"]),
            Route(f"{prefix}/trajectory", gateway.trajectory, methods=["GET"]),
            Route(f"{prefix}/cancel", gateway.cancel, methods=["POST"]),
            Route(f"{prefix}/unregister", gateway.unregister, methods=["POST"]),
            Route(f"{prefix}/models", gateway.models, methods=["GET"]),
            Route(POLICY_VERSION_PATH, gateway.get_policy_version, methods=["GET"]),
            Route(POLICY_VERSION_PATH, gateway.set_policy_version, methods=["POST"]),
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
