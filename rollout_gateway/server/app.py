"""The gateway's Starlette app: protocol v1 routes, bearer-key routes, health and metrics.

See ``/work/shared/DESIGN.md`` (the gateway protocol table) for the contract and the
README ("Reference gateway: limits and security") for our deviations and additions;
every route answers errors as ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from rollout_gateway import protocol
from rollout_gateway.exits import ExitBoard
from rollout_gateway.protocol import (
    API_KEY_RE,
    BEARER_CHAT_COMPLETIONS_PATH,
    BEARER_MODELS_PATH,
    EXITS_MAX_WAIT,
    EXITS_PATH,
    POLICY_VERSION_PATH,
    UNLIMITED_TURNS,
    FailedTurn,
    PolicyVersionResponse,
    RegisterRequest,
    StatusResponse,
    TrajectoryResponse,
    register_response,
)
from rollout_gateway.server.auth import bearer_token, token_matches
from rollout_gateway.server.chat import ChatTurns
from rollout_gateway.server.chat_endpoint import ChatEndpoint
from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.dedupe import TurnTracker
from rollout_gateway.server.dispatch import GatewayApp
from rollout_gateway.server.engines import EngineInfo, probe_engine
from rollout_gateway.server.exit_stream import ExitStreams
from rollout_gateway.server.guard import GuardMiddleware
from rollout_gateway.server.jsonio import BodyParser, JSONBytesResponse
from rollout_gateway.server.limits_v1 import LimitsError, TokenBudget
from rollout_gateway.server.memory import MemoryTrimmer
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
    checked_rollout_id,
    error_response,
    read_json_object,
)
from rollout_gateway.server.token_in import TokenInEngine, load_renderer
from rollout_gateway.server.upstream import UpstreamPool

logger = logging.getLogger("rollout_gateway.server")

_CONTROL_BODY_LIMIT = 1024 * 1024  # register bodies are small


def _optional_positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ApiError(400, f"'{key}' must be a positive integer or null", "invalid_request_error")
    return value


class Gateway:
    """The gateway's state and request handlers (one per app).

    Args:
        config: the settings.
        clock: monotonic clock of idle expiry and retry windows (tests inject a fake one).
        upstream_transport: httpx transport(s) to reach the upstreams (tests).
        token_in: the renderer and generate call of ``upstream_mode="token-in"``; loaded
            from ``config.tokenizer`` / ``config.renderer`` when not given.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        clock: Clock = time.monotonic,
        upstream_transport: httpx.AsyncBaseTransport
        | Mapping[str, httpx.AsyncBaseTransport]
        | None = None,
        token_in: TokenInEngine | None = None,
    ) -> None:
        self.config = config
        if config.upstream_mode == "token-in" and token_in is None:
            if not config.tokenizer:
                raise ValueError("tokenizer: required with upstream_mode 'token-in'")
            token_in = TokenInEngine(load_renderer(config.tokenizer, config.renderer))
        #: Token-in mode's renderer and generate call (``None`` in chat mode).
        self.token_in = token_in if config.upstream_mode == "token-in" else None
        self.pool = UpstreamPool(
            config.upstreams,
            timeout_s=config.upstream_timeout_s,
            connect_timeout_s=config.upstream_connect_timeout_s,
            transport=upstream_transport,
            api_key=config.upstream_api_key,
            max_connections=config.max_connections_per_upstream,
            client=config.upstream_client,
        )
        self.metrics = GatewayMetrics(active_rollouts=lambda: len(self.registry))
        self.registry = RolloutRegistry(
            max_rollouts=config.max_rollouts,
            ttl_s=config.rollout_ttl_s,
            clock=clock,
            on_remove=self._on_remove,
            on_expire=self._on_expire,
        )
        #: The policy version in effect (announced by the trainer).
        self.policy = PolicyClock()
        #: What runs behind each upstream (probed at start-up, again on use until it answers).
        self.engines = {url: EngineInfo() for url in config.upstreams}
        self.chat = ChatTurns(self)
        #: Request-body parsing, with the gateway-wide bound on concurrent big parses.
        self.body_parser = BodyParser(config.max_concurrent_parses)
        self.trimmer = MemoryTrimmer()
        #: Agents' exit reports, streamed or long-polled to envs (see :mod:`rollout_gateway.exits`).
        self.exit_board = ExitBoard()
        #: The open exit streams (capped; ended on shutdown).
        self.exit_streams = ExitStreams(self.exit_board, max_streams=config.max_exit_streams)
        self._model_cards: dict[str, tuple[float, list[dict[str, Any]]]] = {}

    def _on_remove(self, record: RolloutRecord) -> None:
        self.pool.release(record.upstream)
        self.exit_board.forget(record.rollout_id)
        self.trimmer.removed()

    def _on_expire(self, record: RolloutRecord) -> None:
        self.metrics.expired_rollouts.inc()
        logger.info("rollout=%s expired after %.0f s idle", record.rollout_id, self.registry.ttl_s)

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _rollout_id(request: Request) -> str:
        return checked_rollout_id(request.path_params["rollout_id"])

    def _is_admin(self, request: Request) -> bool:
        token = self.config.admin_token
        return token is None or token_matches(bearer_token(request), token)

    def _check_admin(self, request: Request) -> None:
        if not self._is_admin(request):
            raise ApiError(401, "missing or invalid admin token", "unauthorized")

    async def engine(self, url: str) -> EngineInfo:
        """The engine behind ``url``, probed now if the start-up probe found it down."""
        info = self.engines[url]
        if info.due(time.monotonic()):
            await probe_engine(self.pool.get(url).http, info, self.pool.get(url).label)
        return info

    def _record(self, rollout_id: str) -> RolloutRecord:
        record = self.registry.get(rollout_id)
        if record is None:
            raise ApiError(
                404, f"rollout {rollout_id} is not registered", "not_found",
                code="rollout_not_found",
            )  # fmt: skip
        return record

    def agent_record(self, rollout_id: str, token: str | None) -> RolloutRecord:
        """The rollout of a path-routed data-plane call, its key (``token``) checked."""
        record = self._record(checked_rollout_id(rollout_id))
        if record.api_key is not None and not token_matches(token, record.api_key):
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        return record

    def keyed_record(self, token: str | None) -> RolloutRecord:
        """The rollout of a bearer-key routed call (``/v1/chat/completions``)."""
        record = self.registry.by_key(token) if token else None
        if record is None:
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        return record

    def _agent_record(self, request: Request) -> RolloutRecord:
        return self.agent_record(request.path_params["rollout_id"], bearer_token(request))

    def _keyed_record(self, request: Request) -> RolloutRecord:
        return self.keyed_record(bearer_token(request))

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
        if self.registry.get(rollout_id) is not None:
            raise ApiError(409, f"rollout {rollout_id} is already registered", "conflict")

        config = self.config
        upstream = self.pool.pin()
        if max_seq_len is None and config.default_max_context_tokens is None:
            # Default: the context length the engine serves (its /models max_model_len).
            max_seq_len = (await self.engine(upstream.base_url)).max_model_len
        record = RolloutRecord(
            rollout_id=rollout_id,
            model=model,
            sampling_params=sampling,
            # The gateway's default turn budget stands in for "no limit".
            max_turns=config.default_max_turns if max_turns == UNLIMITED_TURNS else max_turns,
            max_seq_len=max_seq_len,
            upstream=upstream.base_url,
            last_activity=self.registry.clock(),
            # The env's proposed key, so it knows the key even if this answer is lost.
            api_key=(proposed_key or secrets.token_urlsafe(32))
            if config.require_rollout_keys
            else None,
            max_total_completion_tokens=min(
                max_completion or config.max_total_completion_tokens,
                config.max_total_completion_tokens,
            ),
            max_context_tokens=max_seq_len or config.default_max_context_tokens,
            max_message_bytes=config.max_rollout_message_bytes,
            turns=TurnTracker(config.retry_dedupe_window_s, self.registry.clock),
            token_budget=token_budget,
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
        logger.info("rollout=%s registered upstream=%s", rollout_id, upstream.label)
        request_body: RegisterRequest = {
            "model": model,
            "sampling_params": sampling,
            "max_turns": max_turns,
            "max_seq_len": max_seq_len,
        }
        answer = register_response(rollout_id, request_body, api_key=record.api_key)
        return JSONBytesResponse(answer)

    async def trajectory(self, request: Request) -> Response:
        """``GET /v1/rollouts/{id}/trajectory``."""
        rollout_id = self._rollout_id(request)
        self._check_admin(request)
        record = self._record(rollout_id)
        self.registry.touch(record)
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
        rollout_id = self._rollout_id(request)
        self._check_admin(request)
        record = self._record(rollout_id)
        record.status = "cancelled"  # no lock: must not wait for a turn in flight
        self.registry.touch(record)
        logger.info("rollout=%s cancelled", rollout_id)
        answer: StatusResponse = {"rollout_id": rollout_id, "status": "cancelled"}
        return JSONBytesResponse(answer)

    async def unregister(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/unregister``: forget the rollout and its trajectory."""
        rollout_id = self._rollout_id(request)
        self._check_admin(request)
        record = self.registry.remove(rollout_id)
        if record is None:
            raise ApiError(
                404, f"rollout {rollout_id} is not registered", "not_found",
                code="rollout_not_found",
            )  # fmt: skip
        logger.info("rollout=%s unregistered turns=%d", rollout_id, record.num_turns)
        answer: StatusResponse = {"rollout_id": rollout_id, "status": record.status}
        return JSONBytesResponse(answer)

    async def exits(self, request: Request) -> Response:
        """``GET /v1/rollouts/exits?after=<seq>&timeout=<s>``: agent exit reports, long-polled.

        With ``stream=1`` (and no ``timeout``), the exit stream instead (see
        :mod:`rollout_gateway.server.exit_stream`).
        """
        self._check_admin(request)
        if request.query_params.get("stream") == "1":
            try:
                return self.exit_streams.response(int(request.query_params.get("after", "0")))
            except ValueError:
                raise ApiError(400, "'after' must be an integer", "invalid_request_error") from None
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
        return JSONBytesResponse(answer)

    # -- data plane ----------------------------------------------------------------------

    async def report_exit(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/exit``: the agent's launch wrapper reports its exit."""
        record = self._agent_record(request)
        body = await read_json_object(request, _CONTROL_BODY_LIMIT)
        exit_code = body.get("exit_code")
        if exit_code is not None and (
            isinstance(exit_code, bool) or not isinstance(exit_code, int)
        ):
            raise ApiError(400, "'exit_code' must be an integer or null", "invalid_request_error")
        self.exit_board.report(record.rollout_id, exit_code)
        return JSONBytesResponse({"rollout_id": record.rollout_id, "status": "exit_reported"})

    async def models(self, request: Request) -> Response:
        """``GET /v1/rollouts/{id}/models``: the upstream's model list (see :meth:`_models`)."""
        return await self._models(self._agent_record(request))

    async def models_by_key(self, request: Request) -> Response:
        """``GET /v1/models`` keyed by the per-rollout bearer key."""
        return await self._models(self._keyed_record(request))

    async def _models(self, record: RolloutRecord) -> Response:
        """The upstream's model cards (with its ``max_model_len``), the registered model
        among them; a bare card of the registered model when the upstream cannot say."""
        cards = await self._upstream_cards(record.upstream)
        if not any(card.get("id") == record.model for card in cards):
            card: dict[str, Any] = {
                "id": record.model,
                "object": "model",
                "created": 0,
                "owned_by": "rollout-gateway",
            }
            lengths = [c["max_model_len"] for c in cards if "max_model_len" in c]
            if lengths:
                card["max_model_len"] = lengths[0]
            cards = [card, *cards]
        return JSONBytesResponse({"object": "list", "data": cards})

    async def _upstream_cards(self, url: str) -> list[dict[str, Any]]:
        now = time.monotonic()
        cached = self._model_cards.get(url)
        if cached is not None and now - cached[0] < 60.0:
            return cached[1]
        cards: list[dict[str, Any]] = []
        with contextlib.suppress(Exception):
            cards = await self.pool.models(url)
        self._model_cards[url] = (now, cards)
        return cards

    # -- policy version ------------------------------------------------------------------

    def _policy_answer(self) -> Response:
        answer: PolicyVersionResponse = {
            "version": self.policy.version,
            "updated_at": self.policy.updated_at,
        }
        return JSONBytesResponse(answer)

    async def get_policy_version(self, request: Request) -> Response:
        """``GET /v1/policy/version``: the version new turns are stamped with."""
        self._check_admin(request)
        return self._policy_answer()

    async def set_policy_version(self, request: Request) -> Response:
        """``POST /v1/policy/version`` ``{"version": int}``: the trainer loaded new weights.

        Turns sent upstream from now on are stamped with it; a turn under way keeps the
        version it started with and gets ``policy_version_end`` when it ends.
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
        """``GET /health``: liveness; upstream states only for the admin."""
        answer: dict[str, Any] = {
            "status": "ok",
            "enabled": self.config.enabled,
            "active_rollouts": len(self.registry),
        }
        warnings = [
            f"upstream {u.label}: {self.engines[u.base_url].describe()['warning']}"
            for u in self.pool.upstreams
            if self.engines[u.base_url].token_ids is False
        ]
        if self.token_in is not None:
            warnings += [
                f"upstream {u.label}: {self.token_in.unserved[u.base_url]}"
                for u in self.pool.upstreams
                if u.base_url in self.token_in.unserved
            ]
        if warnings:
            answer["warnings"] = warnings
        if self._is_admin(request):
            answer["upstreams"] = [
                {**state, **self.engines[u.base_url].describe()}
                for u, state in zip(self.pool.upstreams, self.pool.describe(), strict=True)
            ]
            answer["policy_version"] = self.policy.version
        return JSONBytesResponse(answer)

    async def metrics_endpoint(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text (admin token required when configured)."""
        self._check_admin(request)
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
            *(
                probe_engine(self.pool.get(url).http, info, self.pool.get(url).label)
                for url, info in self.engines.items()
            ),
            *(
                token_in.probe(upstream)
                for token_in in ([self.token_in] if self.token_in is not None else [])
                for upstream in self.pool.upstreams
            ),
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
            self.exit_streams.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.pool.aclose()

    # -- error rendering -----------------------------------------------------------------

    def api_error_response(self, exc: ApiError) -> Response:
        """The answer to a refused request, counted in ``/metrics``."""
        self.metrics.rejected_requests.inc(str(exc.status_code))
        return error_response(
            exc.status_code, exc.message, exc.error_type, code=exc.code, headers=exc.headers
        )

    async def _on_api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return self.api_error_response(exc)

    async def _on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        self.metrics.rejected_requests.inc(str(exc.status_code))
        error_type = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), error_type)


def create_app(
    config: GatewayConfig,
    *,
    clock: Clock = time.monotonic,
    upstream_transport: httpx.AsyncBaseTransport
    | Mapping[str, httpx.AsyncBaseTransport]
    | None = None,
    token_in: TokenInEngine | None = None,
) -> GatewayApp:
    """The gateway ASGI app. Its state is ``app.state.gateway`` (a :class:`Gateway`).

    The agents' chat routes are answered by :class:`~.chat_endpoint.ChatEndpoint` through
    the app's lean path (:mod:`.dispatch`); every other route by Starlette's routing.

    Args:
        config: the settings.
        clock: monotonic clock used for idle expiry (tests inject a fake one).
        upstream_transport: httpx transport for the upstreams, or one per upstream URL
            (tests route to in-process apps with ``httpx.ASGITransport``).
        token_in: token-in mode's engine (see :class:`Gateway`).
    """
    gateway = Gateway(config, clock=clock, upstream_transport=upstream_transport, token_in=token_in)
    chat = ChatEndpoint(gateway, keyed=False)
    chat_by_key = ChatEndpoint(gateway, keyed=True)
    app = GatewayApp(
        chat=chat,
        chat_by_key=chat_by_key,
        routes=[
            Route(EXITS_PATH, gateway.exits, methods=["GET"]),
            Route(protocol.REGISTER_ROUTE, gateway.register, methods=["POST"]),
            Route(protocol.EXIT_ROUTE, gateway.report_exit, methods=["POST"]),
            Route(protocol.CHAT_COMPLETIONS_ROUTE, chat, methods=["POST"]),
            Route(protocol.TRAJECTORY_ROUTE, gateway.trajectory, methods=["GET"]),
            Route(protocol.CANCEL_ROUTE, gateway.cancel, methods=["POST"]),
            Route(protocol.UNREGISTER_ROUTE, gateway.unregister, methods=["POST"]),
            Route(protocol.MODELS_ROUTE, gateway.models, methods=["GET"]),
            Route(BEARER_CHAT_COMPLETIONS_PATH, chat_by_key, methods=["POST"]),
            Route(BEARER_MODELS_PATH, gateway.models_by_key, methods=["GET"]),
            Route(POLICY_VERSION_PATH, gateway.get_policy_version, methods=["GET"]),
            Route(POLICY_VERSION_PATH, gateway.set_policy_version, methods=["POST"]),
            Route("/health", gateway.health, methods=["GET"]),
            Route("/metrics", gateway.metrics_endpoint, methods=["GET"]),
        ],
        middleware=[
            Middleware(GuardMiddleware, on_internal_error=gateway.metrics.internal_errors.inc)
        ],
        exception_handlers={
            ApiError: gateway._on_api_error,
            HTTPException: gateway._on_http_error,
        },
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    return app


__all__ = ["Gateway", "create_app"]
