"""The agents' routes beside chat: their exit report and the model list.

``POST /v1/rollouts/{id}/exit`` (the agent's launch wrapper reports its exit, for the
env's long-poll or stream, see :mod:`rollout_gateway.exits`) and ``GET
/v1/rollouts/{id}/models`` / ``GET /v1/models`` (the rollout found by its key). Like the
chat routes, each takes the rollout's key as its bearer token.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from rollout_gateway.server.http.auth import bearer_token
from rollout_gateway.server.http.jsonio import JSONBytesResponse
from rollout_gateway.server.http.responses import ApiError, ClientGone, parse_json_object

if TYPE_CHECKING:
    from rollout_gateway.server.context import GatewayContext
    from rollout_gateway.server.state.registry import RolloutRecord

#: Largest exit report body (the launch wrapper sends ``{"exit_code": N}``).
EXIT_BODY_LIMIT = 4096

#: Fields of the upstream's model cards that ``/v1/models`` passes on to agents.
_AGENT_CARD_FIELDS = ("id", "object", "created", "owned_by", "max_model_len")


def _exit_too_large() -> ApiError:
    return ApiError(413, f"exit report exceeds {EXIT_BODY_LIMIT} bytes", "request_too_large")


class AgentRoutes:
    """The exit-report and model-list routes of one gateway."""

    def __init__(self, gateway: GatewayContext) -> None:
        self.gateway = gateway
        self._model_cards: dict[str, tuple[float, list[dict[str, Any]]]] = {}

    async def _agent_record(self, request: Request) -> RolloutRecord:
        rollout_id = request.path_params["rollout_id"]
        return await self.gateway.agent_record(rollout_id, bearer_token(request))

    async def _keyed_record(self, request: Request) -> RolloutRecord:
        return await self.gateway.keyed_record(bearer_token(request))

    async def report_exit(self, request: Request) -> Response:
        """``POST /v1/rollouts/{id}/exit``: the agent's launch wrapper reports its exit
        (``{"exit_code": int}``) or, with ``"started": true``, that it started the agent.
        Nothing else of the body is kept: a refusal is the gateway's to report."""
        record = await self._agent_record(request)
        intake = self.gateway.intake
        # Within the rollout's body budgets, like its chat requests: an agent could send
        # any number of these at once.
        lease = intake.lease(record.rollout_id)
        try:
            content_length = request.headers.get("content-length")
            declared = (content_length or "").strip()
            # isdigit() alone takes "²", which int() refuses: ASCII digits, a sane count.
            if declared.isascii() and declared.isdigit() and len(declared) < 20:
                if int(declared) > EXIT_BODY_LIMIT:
                    raise _exit_too_large()
            raw = await intake.read(lease, request.receive, content_length)
            if len(raw) > EXIT_BODY_LIMIT:
                raise _exit_too_large()
            body = await parse_json_object(raw, lambda raw: intake.parse(lease, raw))
        except ClientGone:
            return Response(status_code=499)
        finally:
            lease.release()
        exit_code = body.get("exit_code")
        if exit_code is not None and (
            isinstance(exit_code, bool) or not isinstance(exit_code, int)
        ):
            raise ApiError(400, "'exit_code' must be an integer or null", "invalid_request_error")
        started = body.get("started", False)
        if not isinstance(started, bool):
            raise ApiError(400, "'started' must be true or false", "invalid_request_error")
        await self.gateway.report_exit(record.rollout_id, exit_code, started=started)
        return JSONBytesResponse({"rollout_id": record.rollout_id, "status": "exit_reported"})

    async def models(self, request: Request) -> Response:
        """``GET /v1/rollouts/{id}/models``: the upstream's model list (see :meth:`_models`)."""
        return await self._models(await self._agent_record(request))

    async def models_by_key(self, request: Request) -> Response:
        """``GET /v1/models`` keyed by the per-rollout bearer key."""
        return await self._models(await self._keyed_record(request))

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
            cards = await self.gateway.pool.models(url)
        # Only the OpenAI card fields and the context length reach an agent: vLLM's and
        # SGLang's ``root`` is the model's directory on the engine's host, ``parent`` an
        # adapter's base, ``permission`` the engine's own records.
        cards = [{k: card[k] for k in _AGENT_CARD_FIELDS if k in card} for card in cards]
        self._model_cards[url] = (now, cards)
        return cards


__all__ = ["AgentRoutes"]
