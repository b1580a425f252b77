"""A dialect's token count (Anthropic's ``/v1/messages/count_tokens``): answered, never a turn.

The request is read within the rollout's body budgets like a turn's, parsed as a turn's
would be, and counted: exactly by the renderer in token-in mode, exactly by vLLM's own
``POST /tokenize`` (at its root) in front of vLLM, else estimated from its size
(:func:`~rollout_gateway.server.dialects.anthropic.estimated_input_tokens`). Nothing is
recorded and no turn is counted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from rollout_gateway.server.agents.request import AgentRequest
from rollout_gateway.server.dialects.anthropic import AnthropicDialect, estimated_input_tokens
from rollout_gateway.server.dialects.base import Dialect, ParsedRequest
from rollout_gateway.server.http import jsonio
from rollout_gateway.server.http.jsonio import JSONBytesResponse
from rollout_gateway.server.http.responses import ClientGone, parse_json_object

if TYPE_CHECKING:
    from rollout_gateway.server.context import GatewayContext
    from rollout_gateway.server.state.registry import RolloutRecord

logger = logging.getLogger("rollout_gateway.server")


class TokenCounts:
    """The token-count side routes of one gateway."""

    def __init__(self, gateway: GatewayContext) -> None:
        self.gateway = gateway

    async def count_tokens(
        self, request: AgentRequest, record: RolloutRecord, dialect: Dialect
    ) -> Response:
        """A dialect's token count (``/v1/messages/count_tokens``): answered within the
        rollout's body budgets, never recorded, no turn counted."""
        assert isinstance(dialect, AnthropicDialect)
        intake = self.gateway.intake
        lease = request.lease = intake.lease(record.rollout_id)  # the endpoint releases it
        try:
            raw = await intake.read(
                lease, request.receive, request.content_length, request.read_timer
            )
        except ClientGone:
            return Response(status_code=499)
        body = await parse_json_object(raw, lambda raw: intake.parse(lease, raw))
        del raw
        lease.drop_raw()
        parsed = await intake.offload(lease, dialect.parse_count, body)
        count = await self._count(record, parsed)
        return JSONBytesResponse(dialect.render_count(count))

    async def _count(self, record: RolloutRecord, parsed: ParsedRequest) -> int:
        """The request's prompt tokens: the renderer's count in token-in mode, vLLM's own
        (``POST /tokenize`` at its root) in front of vLLM, else an estimate from its size
        (:func:`estimated_input_tokens`)."""
        gateway = self.gateway
        tools = parsed.body.get("tools")
        try:
            if gateway.token_in is not None:
                return await gateway.token_in.count_prompt(parsed.messages, tools)
            if (await gateway.engine(record.upstream)).kind == "vllm":
                return await self._engine_count(record, parsed.messages, tools)
        except Exception as exc:  # an engine or renderer that cannot say: the estimate
            logger.info("rollout=%s count_tokens estimated: %r", record.rollout_id, exc)
        return estimated_input_tokens(parsed)

    async def _engine_count(self, record: RolloutRecord, messages: list[Any], tools: Any) -> int:
        upstream = self.gateway.pool.get(record.upstream)
        root = upstream.base_url.rstrip("/").removesuffix("/v1")
        body: dict[str, Any] = {
            "model": record.model,
            "messages": messages,
            "add_generation_prompt": True,
        }
        if tools:
            body["tools"] = tools
        async with asyncio.timeout(self.gateway.pool.timeout_s):
            answer = await upstream.http.post(f"{root}/tokenize", jsonio.dumps(body))
        count = jsonio.loads(answer.content).get("count") if answer.status_code == 200 else None
        if not isinstance(count, int):
            raise ValueError(f"/tokenize answered {answer.status_code}")
        return count


__all__ = ["TokenCounts"]
