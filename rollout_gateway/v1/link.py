"""One v1 rollout's registration at the gateway: register, slot URL, trajectory, finalize once.

The v1 adapter does not own the agent's process (v1's harness runtime runs it), so the
only lifecycle it drives is the gateway's: this module is that lifecycle, in one place,
over the core's :class:`~rollout_gateway.client.GatewayClient` and
:class:`~rollout_gateway.tunnels.TunnelPool`. Every failure comes out as a v1 error
(:mod:`rollout_gateway.v1.errors`); :meth:`RolloutLink.finalize` runs at most once and
never raises.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient
from rollout_gateway.errors import RolloutGatewayError, RolloutNotFoundError
from rollout_gateway.tunnels import TunnelPool
from rollout_gateway.v1.errors import to_v1_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegisterSpec:
    """What a rollout registers: model, sampling, v1's limits and the context bound."""

    model: str
    sampling_params: dict[str, Any]
    max_turns: int = protocol.UNLIMITED_TURNS
    max_seq_len: int | None = None
    limits: dict[str, int] = field(default_factory=dict)


class RolloutLink:
    """A rollout's registration at one gateway, from register to unregister.

    Args:
        client: the control-plane client of the rollout's gateway.
        tunnels: the shared tunnel pool (one tunnel per gateway host).
        rollout_id: the rollout id (fresh and unguessable; default: a new one).
    """

    def __init__(
        self, client: GatewayClient, tunnels: TunnelPool, rollout_id: str | None = None
    ) -> None:
        self.client = client
        self.tunnels = tunnels
        self.rollout_id = rollout_id or protocol.new_rollout_id()
        self.api_key = ""
        self.registered = False
        self._finalized = False

    async def register(self, spec: RegisterSpec) -> None:
        """Register the rollout; afterwards :attr:`api_key` is its data-plane key."""
        proposed = protocol.new_rollout_api_key()
        try:
            answer = await self.client.register(
                self.rollout_id,
                model=spec.model,
                sampling_params=spec.sampling_params,
                max_turns=spec.max_turns,
                max_seq_len=spec.max_seq_len,
                api_key=proposed,
                extra=dict(spec.limits) or None,
            )
        except RolloutGatewayError as e:
            raise to_v1_error(e, "gateway register") from e
        self.registered = True
        self.api_key = answer.get("api_key") or proposed

    async def public_root(self) -> str:
        """The gateway's root as the agent reaches it (the shared tunnel's URL)."""
        try:
            return await self.tunnels.get_url(self.client.base_url)
        except RolloutGatewayError as e:
            raise to_v1_error(e, "gateway tunnel") from e

    async def trajectory(self) -> protocol.TrajectoryResponse:
        """The trajectory the gateway recorded so far."""
        try:
            return await self.client.get_trajectory(self.rollout_id)
        except RolloutGatewayError as e:
            raise to_v1_error(e, "gateway trajectory") from e

    async def finalize(self, *, cancelled: bool) -> Exception | None:
        """Cancel (if ``cancelled``) and unregister, once; returns the failure, if any.

        Runs to its end even if the caller is cancelled meanwhile (the cancellation is
        re-raised afterwards); a second call does nothing. A 404 on unregister means the
        rollout is already gone (idle expiry).
        """
        if self._finalized or not self.registered:
            return None
        self._finalized = True
        task = asyncio.ensure_future(self._finalize(cancelled))
        interrupted = False
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                interrupted = True  # finish the cleanup first, then propagate
        if interrupted:
            raise asyncio.CancelledError
        return task.result()

    async def _finalize(self, cancelled: bool) -> Exception | None:
        if cancelled:
            try:
                await self.client.cancel(self.rollout_id)
            except RolloutGatewayError as e:
                logger.warning("rollout=%s cancel failed: %s", self.rollout_id, e)
        try:
            await self.client.unregister(self.rollout_id)
        except RolloutNotFoundError:
            logger.debug("rollout=%s already unregistered", self.rollout_id)
        except RolloutGatewayError as e:
            logger.warning("rollout=%s unregister failed: %s", self.rollout_id, e)
            return to_v1_error(e, "gateway unregister")
        return None


__all__ = ["RegisterSpec", "RolloutLink"]
