"""The gateway as its request handlers see it: :class:`GatewayContext`.

:mod:`.app` builds the gateway (:class:`~.app.Gateway`) and hands it to the agent API
(:mod:`.agents`) and the control plane (:mod:`.control`). They type it as this protocol,
so that they never import the module that imports them, and so that what they use of the
gateway is named in one place: its settings, the state it must not lose
(:mod:`.state`), its engines (:mod:`.engines`) and its metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from rollout_gateway.exits import ExitBoard
    from rollout_gateway.server.config import GatewayConfig
    from rollout_gateway.server.engines.probe import EngineInfo
    from rollout_gateway.server.engines.token_in import TokenInEngine
    from rollout_gateway.server.engines.upstream import UpstreamPool
    from rollout_gateway.server.http.intake import BodyIntake
    from rollout_gateway.server.http.responses import ApiError
    from rollout_gateway.server.ops.metrics import GatewayMetrics
    from rollout_gateway.server.state.coordinator import TurnCoordinator
    from rollout_gateway.server.state.ledger import RolloutLedger
    from rollout_gateway.server.state.policy import PolicyClock
    from rollout_gateway.server.state.registry import RolloutRecord, RolloutRegistry
    from rollout_gateway.server.state.store import RolloutStore
    from rollout_gateway.server.state.stored import StoredRollouts


class GatewayContext(Protocol):
    """What the agent API and the control plane use of the gateway (one per app)."""

    #: The settings.
    config: GatewayConfig
    #: The registered rollouts (records, keys, recorded turns, budgets).
    registry: RolloutRegistry
    #: The registry written through to the state store, and read back.
    rollouts: StoredRollouts
    #: The records' one owner: every change of a rollout's status and counters.
    ledger: RolloutLedger
    #: The state store.
    store: RolloutStore
    #: How turns are taken, exit reports numbered and other gateways heard.
    coordinator: TurnCoordinator
    #: The policy version in effect.
    policy: PolicyClock
    #: The agents' exit reports.
    exit_board: ExitBoard
    #: The upstreams, and the engine behind each (:meth:`engine`).
    pool: UpstreamPool
    #: Token-in mode's renderer and generate call (``None`` in chat mode).
    token_in: TokenInEngine | None
    #: Request bodies: admitted, costed and parsed within the gateway's bounds.
    intake: BodyIntake
    metrics: GatewayMetrics

    async def engine(self, url: str) -> EngineInfo:
        """The engine behind upstream ``url``."""
        ...

    async def record(self, rollout_id: str) -> RolloutRecord:
        """The registered rollout ``rollout_id`` (404 when it is not)."""
        ...

    async def agent_record(self, rollout_id: str, token: str | None) -> RolloutRecord:
        """The rollout of a path-routed agent call, its key (``token``) checked."""
        ...

    async def keyed_record(self, token: str | None) -> RolloutRecord:
        """The rollout of a call routed by its key (``token``)."""
        ...

    async def report_exit(
        self, rollout_id: str, exit_code: int | None, *, started: bool = False
    ) -> None:
        """Keep an agent's report (numbered for every gateway on a shared store)."""
        ...

    def check_admin(self, request: Request) -> None:
        """Refuse ``request`` (401) unless it carries the admin token."""
        ...

    def api_error_response(self, exc: ApiError) -> Response:
        """The answer to a refused request, counted in ``/metrics``."""
        ...


__all__ = ["GatewayContext"]
