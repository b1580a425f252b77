"""The gateway's Starlette app: protocol v1 routes, bearer-key routes, health and metrics.

The contract is :mod:`rollout_gateway.protocol` (paths, bodies, answers) and the docs'
protocol page (``docs/protocol.md``); their security and limits pages say what this
gateway adds and where it deviates. Every route answers errors as
``{"error": {"message", "type", "code"}}`` (``code`` a string).

:class:`Gateway` holds the gateway's state and parts; :func:`create_app` wires the layers
in the order a request meets them: HTTP transport (:mod:`.http`), the agent API
(:mod:`.agents`) and the control plane (:mod:`.control`), which reach the engines
(:mod:`.engines`), the recorded trajectories (:mod:`.recording`) and the rollouts' state
(:mod:`.state`) through the gateway (:class:`~.context.GatewayContext`). Its state opens
and closes with the app (:mod:`.lifespan`).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any, TypedDict, Unpack

import httpx
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from rollout_gateway import protocol
from rollout_gateway.exits import ExitBoard, agent_report
from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.agents.chat import ChatTurns
from rollout_gateway.server.agents.endpoint import AgentEndpoint
from rollout_gateway.server.agents.routes import AgentRoutes
from rollout_gateway.server.agents.turn_runner import store_refusal
from rollout_gateway.server.config import GatewayConfig
from rollout_gateway.server.control.exit_stream import ExitStreams
from rollout_gateway.server.control.plane import ControlPlane
from rollout_gateway.server.dialects.routes import DIALECTS
from rollout_gateway.server.engines.probe import EngineInfo, probe_engine
from rollout_gateway.server.engines.token_in import TokenInEngine, load_renderer
from rollout_gateway.server.engines.upstream import UpstreamPool
from rollout_gateway.server.http.auth import bearer_token, token_matches
from rollout_gateway.server.http.dispatch import GatewayApp
from rollout_gateway.server.http.fds import FdPlan, fd_limit, plan_fds
from rollout_gateway.server.http.guard import GuardMiddleware
from rollout_gateway.server.http.intake import BodyIntake
from rollout_gateway.server.http.jsonio import JSONBytesResponse
from rollout_gateway.server.http.responses import ApiError, checked_rollout_id, error_response
from rollout_gateway.server.lifespan import lifespan
from rollout_gateway.server.ops.health import HealthMonitor
from rollout_gateway.server.ops.memory import MemoryTrimmer
from rollout_gateway.server.ops.metrics import GatewayMetrics
from rollout_gateway.server.state.backends import state_for
from rollout_gateway.server.state.coordinator import TurnCoordinator
from rollout_gateway.server.state.ledger import RolloutLedger
from rollout_gateway.server.state.policy import PolicyClock
from rollout_gateway.server.state.registry import (
    Clock,
    RolloutRecord,
    RolloutRegistry,
    key_digest,
    key_matches,
)
from rollout_gateway.server.state.store import PolicyState, RolloutStore, StoreError
from rollout_gateway.server.state.stored import StoredRollouts

logger = logging.getLogger("rollout_gateway.server")

#: A turn's claim on a shared store outlives the longest upstream call by this much
#: before another gateway may take it over (its holder is then taken for dead).
_CLAIM_MARGIN_S = 60.0


def _wall_clock(clock: Clock) -> Clock:
    """Unix time that moves with ``clock`` (a test's fake monotonic clock moves it too)."""
    offset = time.time() - clock()
    return lambda: offset + clock()


class GatewayParts(TypedDict, total=False):
    """Parts a caller may give a gateway instead of those its settings name (tests, a
    process that embeds the gateway)."""

    #: Monotonic clock of idle expiry and retry windows (tests inject a fake one).
    clock: Clock
    #: httpx transport for the upstreams, or one per upstream URL (tests route to
    #: in-process apps with ``httpx.ASGITransport``).
    upstream_transport: httpx.AsyncBaseTransport | Mapping[str, httpx.AsyncBaseTransport] | None
    #: Token-in mode's renderer and generate call (default: loaded from
    #: ``config.upstream.tokenizer`` / ``config.upstream.renderer``).
    token_in: TokenInEngine | None
    #: Where the state goes (default: the backend the settings name,
    #: :func:`~.state.backends.store_for`); opened with the app (:mod:`.lifespan`).
    store: RolloutStore | None
    #: How turns are taken and exit reports numbered (default: the store's own,
    #: :meth:`~.state.store.RolloutStore.coordinator`).
    coordinator: TurnCoordinator | None


def _upstream_pool(
    config: GatewayConfig,
    transport: httpx.AsyncBaseTransport | Mapping[str, httpx.AsyncBaseTransport] | None,
) -> tuple[FdPlan, UpstreamPool]:
    """How the process's file descriptors are shared, and the upstreams' pools within it."""
    fd_plan = plan_fds(
        fd_limit(),
        max_connections=config.connections.max_connections,
        per_upstream_pool=config.upstream.max_connections_per_upstream,
        # Each upstream has its lean pool and an httpx one beside it.
        upstream_pools=len(config.upstreams) * 2,
    )
    pool = UpstreamPool(
        config.upstreams,
        timeout_s=config.upstream.upstream_timeout_s,
        connect_timeout_s=config.upstream.upstream_connect_timeout_s,
        transport=transport,
        api_key=config.upstream.upstream_api_key,
        max_connections=fd_plan.upstream_connections,
    )
    return fd_plan, pool


def _exit_streams(config: GatewayConfig, fd_plan: FdPlan, board: ExitBoard) -> ExitStreams:
    """The exit streams' registry: each holds a connection open, so at most half the cap."""
    max_streams = min(config.connections.max_exit_streams, fd_plan.agent_connections // 2)
    return ExitStreams(board, max_streams=max(1, max_streams))


def _token_in(config: GatewayConfig, given: TokenInEngine | None) -> TokenInEngine | None:
    """Token-in mode's engine (``None`` in chat mode)."""
    if config.upstream.upstream_mode != "token-in":
        return None
    if given is not None:
        return given
    if not config.upstream.tokenizer:
        raise ValueError("tokenizer: required with upstream_mode 'token-in'")
    return TokenInEngine(load_renderer(config.upstream.tokenizer, config.upstream.renderer))


class Gateway:
    """The gateway's state and parts, and its operational routes (one per app).

    Args:
        config: the settings.
        parts: what to use instead of what ``config`` names (:class:`GatewayParts`).
    """

    def __init__(self, config: GatewayConfig, **parts: Unpack[GatewayParts]) -> None:
        self.config = config
        clock = parts.get("clock") or time.monotonic
        #: Token-in mode's renderer and generate call (``None`` in chat mode).
        self.token_in = _token_in(config, parts.get("token_in"))
        #: How the process's file descriptors are shared (connection caps), and the
        #: upstreams' connection pools within them.
        self.fd_plan, self.pool = _upstream_pool(config, parts.get("upstream_transport"))
        self.metrics = GatewayMetrics(
            active_rollouts=lambda: len(self.registry),
            healthy=lambda: float(self.health_monitor.report(admin=False).healthy),
            dependencies_up=lambda: self.health_monitor.up_values(),
        )
        self.registry = RolloutRegistry(
            max_rollouts=config.registry.max_rollouts,
            ttl_s=config.registry.rollout_ttl_s,
            clock=clock,
            on_remove=self._on_remove,
            on_expire=self._on_expire,
        )
        #: Where what must not be lost goes, and how turns are taken (:mod:`.state`).
        self.store, self.coordinator = state_for(
            config, parts.get("store"), parts.get("coordinator")
        )
        #: Whether the upstreams and the store answer (probed on a timer; ``/health``).
        self.health_monitor = HealthMonitor(
            self.pool.upstreams,
            self.store.check,
            self.store.name,
            interval_s=config.upstream.probe_interval_s,
        )
        #: Whether the store and the coordinator are open (:mod:`.lifespan`).
        self.state_open = False
        #: The registry written through to the store, and the records' one owner (each
        #: change of a rollout's status and counters).
        self.rollouts, self.ledger = self._written_through(clock)
        #: The policy version in effect (announced by the trainer).
        self.policy = PolicyClock()
        #: What runs behind each upstream (probed at start-up, again on use until it answers).
        self.engines = {url: EngineInfo() for url in config.upstreams}
        self.chat = ChatTurns(self)
        self.trimmer = MemoryTrimmer()
        #: Request bodies: admitted, costed and parsed within the gateway's bounds.
        self.intake = BodyIntake(config.intake, on_big_release=self.trimmer.freed)
        #: Agents' exit reports, streamed or long-polled to envs (see :mod:`rollout_gateway.exits`),
        #: numbered as the coordinator numbers them.
        self.exit_board = self.coordinator.exit_board()
        #: The open exit streams (capped; ended on shutdown).
        self.exit_streams = _exit_streams(config, self.fd_plan, self.exit_board)
        self.coordinator.watch(self)

    def _written_through(self, clock: Clock) -> tuple[StoredRollouts, RolloutLedger]:
        """The registry kept in step with the store and the ledger, under one owner id
        (the claims this gateway takes are its)."""
        config = self.config
        owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        wall_clock = _wall_clock(clock)
        rollouts = StoredRollouts(
            self.registry,
            self.store,
            self.coordinator,
            owner=owner,
            lease_s=config.upstream.upstream_timeout_s + _CLAIM_MARGIN_S,
            retry_window_s=config.limits.retry_dedupe_window_s,
            clock=clock,
            wall_clock=wall_clock,
            on_load=self.pin_loaded,
        )
        return rollouts, RolloutLedger(self.store, owner=owner, wall_clock=wall_clock)

    def _on_remove(self, record: RolloutRecord) -> None:
        self.pool.release(record.upstream)
        self.coordinator.dropped(record.rollout_id)
        self.trimmer.removed()

    def _on_expire(self, record: RolloutRecord) -> None:
        # (Dropped from this gateway; from the store when it is idle at every gateway
        # sharing it: see StoredRollouts.expired.)
        self.rollouts.expired(record)
        self.metrics.expired_rollouts.inc()
        logger.info("rollout=%s expired after %.0f s idle", record.rollout_id, self.registry.ttl_s)

    def pin_loaded(self, record: RolloutRecord) -> None:
        """A record read back from the store: pin it to its upstream, or to another one
        when this gateway does not have that upstream."""
        if record.upstream in self.engines:
            self.pool.get(record.upstream).pinned += 1
        else:
            record.upstream = self.pool.pin().base_url

    # -- what other gateways on a shared store changed (StoreEvents) ----------------------

    def exit_reported(self, report: ExitReport) -> None:
        """An exit report numbered for every gateway sharing the store."""
        self.exit_board.apply(report)

    def rollout_removed(self, rollout_id: str) -> None:
        """A rollout was unregistered at some gateway: drop it here too."""
        self.rollouts.removed_elsewhere(rollout_id)
        self.exit_board.forget(rollout_id)

    async def missed_events(self) -> None:
        """Removals may have been missed: drop the rollouts the store no longer has."""
        for rollout_id in await self.rollouts.unstored():
            self.exit_board.forget(rollout_id)
            logger.info("rollout=%s dropped: no longer stored (removed elsewhere)", rollout_id)

    def policy_announced(self, state: PolicyState) -> None:
        """A policy version was announced at some gateway."""
        if state.version is not None:
            self.policy.adopt(state.version, state.updated_at)

    async def report_exit(
        self, rollout_id: str, exit_code: int | None, *, started: bool = False
    ) -> None:
        """Keep an agent's report, numbered as the coordinator numbers them (by this
        gateway's board, or once for every gateway sharing the store: then stored when
        this returns, else a 503)."""
        await self.coordinator.report_exit(agent_report(rollout_id, exit_code, started=started))

    # -- helpers -------------------------------------------------------------------------

    def is_admin(self, request: Request) -> bool:
        """Whether ``request`` carries the admin token (or the control plane is open)."""
        token = self.config.admin_token
        return token is None or token_matches(bearer_token(request), token)

    def check_admin(self, request: Request) -> None:
        """Refuse ``request`` (401) unless :meth:`is_admin`."""
        if not self.is_admin(request):
            raise ApiError(401, "missing or invalid admin token", "unauthorized")

    async def engine(self, url: str) -> EngineInfo:
        """The engine behind ``url``, probed now if the start-up probe found it down."""
        info = self.engines[url]
        if info.due(time.monotonic()):
            await probe_engine(self.pool.get(url).http, info, self.pool.get(url).label)
        return info

    async def record(self, rollout_id: str) -> RolloutRecord:
        """The registered rollout ``rollout_id`` (404 when it is not)."""
        record = await self.rollouts.find(rollout_id)
        if record is None:
            raise ApiError(
                404,
                f"rollout {rollout_id} is not registered",
                "not_found",
                code="rollout_not_found",
            )
        return record

    async def agent_record(self, rollout_id: str, token: str | None) -> RolloutRecord:
        """The rollout of a path-routed data-plane call, its key (``token``) checked.

        With per-rollout keys, no key is a 401; a key that is not the rollout's is the
        same 404 as an unknown rollout, after the same comparison: an agent holding one
        rollout's key cannot tell whether another rollout id is registered.
        """
        rollout_id = checked_rollout_id(rollout_id)
        if not self.config.require_rollout_keys:
            return await self.record(rollout_id)
        if token is None:
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        record = await self.rollouts.find(rollout_id)
        digest = record.key_digest if record is not None else None
        if not key_matches(token, digest):
            raise ApiError(
                404,
                f"rollout {rollout_id} is not registered (or the api key is not its key)",
                "not_found",
                code="rollout_not_found",
            )
        assert record is not None
        return record

    async def keyed_record(self, token: str | None) -> RolloutRecord:
        """The rollout of a bearer-key routed call (``/v1/chat/completions``)."""
        record = await self.rollouts.find_by_key(key_digest(token)) if token else None
        if record is None:
            raise ApiError(401, "missing or invalid rollout api key", "unauthorized")
        return record

    # -- operations ----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 while the gateway can serve turns (its store and an
        upstream answer: :mod:`.ops.health`), else 503; the reasons; the upstreams' and
        the store's states only for the admin."""
        admin = self.is_admin(request)
        report = self.health_monitor.report(admin=admin)
        answer: dict[str, Any] = {
            "status": report.status,
            "healthy": report.healthy,
            "enabled": self.config.enabled,
            "active_rollouts": len(self.registry),
        }
        if report.reasons:
            answer["reasons"] = list(report.reasons)
        problems = [
            (u.label, self.engines[u.base_url].describe()["warning"])
            for u in self.pool.upstreams
            if self.engines[u.base_url].token_ids is False
        ]
        if self.token_in is not None:
            problems += [
                (u.label, self.token_in.unserved[u.base_url])
                for u in self.pool.upstreams
                if u.base_url in self.token_in.unserved
            ]
        if problems:
            # Upstream URLs are the admin's only (the agents reach /health too).
            warnings = [f"upstream {label}: {text}" if admin else text for label, text in problems]
            answer["warnings"] = list(dict.fromkeys(warnings))
        if admin:
            answer["state"] = {"backend": self.store.name, "durable": self.store.durable}
            answer["upstreams"] = [
                {**state, **self.engines[u.base_url].describe()}
                for u, state in zip(self.pool.upstreams, self.pool.describe(), strict=True)
            ]
            answer["policy_version"] = self.policy.version
            answer["checks"] = list(report.dependencies)
        return JSONBytesResponse(answer, status_code=200 if report.healthy else 503)

    async def live(self, request: Request) -> Response:
        """``GET /health/live``: 200 while the process serves HTTP, whatever its upstreams
        and store (a supervisor's liveness check; ``/health`` is the readiness check)."""
        return JSONBytesResponse({"status": "alive"})

    async def metrics_endpoint(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text (admin token required when configured)."""
        self.check_admin(request)
        return PlainTextResponse(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def sweep(self) -> int:
        """Expire idle rollouts now; returns how many were dropped."""
        return len(self.registry.expire_idle())

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

    async def _on_store_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StoreError)
        rollout_id = (request.path_params or {}).get("rollout_id", "-")
        return self.api_error_response(store_refusal(exc, str(rollout_id)))

    async def _on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        self.metrics.rejected_requests.inc(str(exc.status_code))
        error_type = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), error_type)


def _dialect_endpoints(
    gateway: Gateway,
) -> tuple[dict[tuple[str, bool, bool], AgentEndpoint], list[Route]]:
    """The endpoints of the dialects beside chat (Anthropic Messages, OpenAI Responses),
    for the lean path by (dialect, side route, keyed), and as Starlette routes (other
    methods get its 405; an encoded path its routing)."""
    apps: dict[tuple[str, bool, bool], AgentEndpoint] = {}
    routes: list[Route] = []
    for dialect in DIALECTS:
        if dialect.name == "chat":
            continue
        for keyed in (False, True):
            paths = (
                (dialect.keyed_routes, dialect.keyed_aux_routes)
                if keyed
                else (dialect.routes, dialect.aux_routes)
            )
            for aux, group in ((False, paths[0]), (True, paths[1])):
                app = AgentEndpoint(gateway.chat, keyed=keyed, dialect=dialect, aux=aux)
                apps[(dialect.name, aux, keyed)] = app
                for path in group:
                    full = path if keyed else protocol.ROLLOUT_PREFIX + path
                    routes.append(Route(full, app, methods=["POST"]))
    return apps, routes


def create_app(config: GatewayConfig, **parts: Unpack[GatewayParts]) -> GatewayApp:
    """The gateway ASGI app of ``config`` (with ``parts``: see :class:`GatewayParts`). Its
    state is ``app.state.gateway`` (a :class:`Gateway`).

    The agents' chat routes are answered by :class:`~.agents.endpoint.ChatEndpoint` through
    the app's lean path (:mod:`.http.dispatch`); every other route by Starlette's routing.
    """
    gateway = Gateway(config, **parts)
    chat = AgentEndpoint(gateway.chat, keyed=False)
    chat_by_key = AgentEndpoint(gateway.chat, keyed=True)
    dialects, dialect_routes = _dialect_endpoints(gateway)
    agent = AgentRoutes(gateway)
    control = ControlPlane(gateway, gateway.exit_streams)
    app = GatewayApp(
        chat=chat,
        chat_by_key=chat_by_key,
        dialects=dialects,
        routes=[
            *dialect_routes,
            Route(protocol.EXITS_PATH, control.exits, methods=["GET"]),
            Route(protocol.REGISTER_ROUTE, control.register, methods=["POST"]),
            Route(protocol.EXIT_ROUTE, agent.report_exit, methods=["POST"]),
            Route(protocol.CHAT_COMPLETIONS_ROUTE, chat, methods=["POST"]),
            Route(protocol.TRAJECTORY_ROUTE, control.trajectory, methods=["GET"]),
            Route(protocol.CANCEL_ROUTE, control.cancel, methods=["POST"]),
            Route(protocol.UNREGISTER_ROUTE, control.unregister, methods=["POST"]),
            Route(protocol.MODELS_ROUTE, agent.models, methods=["GET"]),
            Route(protocol.BEARER_CHAT_COMPLETIONS_PATH, chat_by_key, methods=["POST"]),
            Route(protocol.BEARER_MODELS_PATH, agent.models_by_key, methods=["GET"]),
            Route(protocol.POLICY_VERSION_PATH, control.get_policy_version, methods=["GET"]),
            Route(protocol.POLICY_VERSION_PATH, control.set_policy_version, methods=["POST"]),
            Route("/health", gateway.health, methods=["GET"]),
            Route("/health/live", gateway.live, methods=["GET"]),
            Route("/metrics", gateway.metrics_endpoint, methods=["GET"]),
        ],
        middleware=[
            Middleware(GuardMiddleware, on_internal_error=gateway.metrics.internal_errors.inc)
        ],
        exception_handlers={
            ApiError: gateway._on_api_error,
            StoreError: gateway._on_store_error,
            HTTPException: gateway._on_http_error,
        },
        lifespan=functools.partial(lifespan, gateway),
    )
    # A path with a trailing slash is a 404 like any unknown path, not Starlette's 307 to
    # the slashless path built from the client's Host header (an empty body, not an error).
    app.router.redirect_slashes = False
    app.state.gateway = gateway
    return app


__all__ = ["Gateway", "GatewayParts", "create_app"]
