"""Which core rollout a verifiers state is, for the steps that receive only the state.

Inside ``rollout()``, a step acts through the :class:`~rollout_gateway.lifecycle.GatewayRollout`
``rollout()`` runs (found by the state's ``rollout_id``). Called on its own (an env's own
driver of the steps, the earlier mixin's own tests), it acts through one made for the
state from what it holds, as the earlier mixin's steps did (docs/classic.md): possibly
registered (``cancel_rollout`` and ``unregister_rollout`` go out), and kept, with its
per-rollout key, from a direct ``register_rollout(state)`` to ``unregister_rollout(state)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from rollout_gateway.errors import GatewayConfigError
from rollout_gateway.lifecycle import GatewayRollout
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.tunnels import TunnelPool

if TYPE_CHECKING:
    from verifiers.types import State

#: The gateway rollout the current task runs (for steps whose signature carries no state).
#: A weak reference: contexts are copied into every timer and callback scheduled during
#: the rollout (some outlive it in the event loop's heap), and must not keep a finished
#: rollout, with its trajectory, alive. :meth:`StateRollouts.running` holds the rollout.
current_rollout: ContextVar[weakref.ref[GatewayRollout] | None] = ContextVar(
    "rollout_gateway_current_rollout", default=None
)


def host_gateway_url(settings: GatewaySettings, host: str) -> str:
    """The gateway at ``host`` on ``gateway_port`` (the scheme of the configured URL)."""
    scheme = (settings.gateway_url or "http://").split("://", 1)[0]
    return f"{scheme}://{host}:{settings.gateway_port}"


async def shared_tunnel_url(
    tunnels: TunnelPool, settings: GatewaySettings, local_addr: str | None
) -> str:
    """The earlier mixin's ``get_gateway_tunnel_url(local_addr)`` outside a rollout: the
    tunnel of ``local_addr`` on ``gateway_port`` (started if needed); without it, the one
    tunnel open (or the configured ``gateway_url``'s); ``ValueError`` when ambiguous."""
    if local_addr is not None:
        return await tunnels.get_url(host_gateway_url(settings, local_addr))
    gateways = tunnels.gateway_urls()
    if not gateways and settings.gateway_url:
        gateways = [settings.gateway_url]
    if len(gateways) == 1:
        return await tunnels.get_url(gateways[0])  # replaced if it died
    if not gateways:
        raise ValueError("local_addr is required when starting tunnel")
    raise ValueError("local_addr is required when multiple tunnels are active")


class StateRollouts:
    """One env's gateway rollouts, by the ``rollout_id`` of their verifiers state.

    Args:
        make: a new core rollout of the env, with the given id (``None``: a fresh one).
        locate: the gateway URL of a state's rollout (see the module docstring).
    """

    def __init__(
        self,
        make: Callable[[str | None], GatewayRollout],
        locate: Callable[[State], str],
    ) -> None:
        self._make = make
        self._locate = locate
        self._running: dict[str, GatewayRollout] = {}
        #: Registered by a direct ``register_rollout(state)``, until unregistered.
        self._kept: dict[str, GatewayRollout] = {}

    @contextmanager
    def running(self, rollout: GatewayRollout) -> Iterator[None]:
        """``rollout()`` runs ``rollout`` meanwhile: the steps of its state find it."""
        self._running[rollout.rollout_id] = rollout
        token = current_rollout.set(weakref.ref(rollout))
        try:
            yield
        finally:
            current_rollout.reset(token)
            self._running.pop(rollout.rollout_id, None)

    def is_running(self, rollout: GatewayRollout) -> bool:
        """Whether ``rollout()`` runs ``rollout`` (else a step was called on its own)."""
        return self._running.get(rollout.rollout_id) is rollout

    def get(self, state: State) -> GatewayRollout | None:
        """The rollout ``rollout()`` runs for ``state``, or one a direct register keeps."""
        rollout_id = state.get("rollout_id") or ""
        return self._running.get(rollout_id) or self._kept.get(rollout_id)

    def of(self, state: State) -> GatewayRollout:
        """The rollout ``state`` is: :meth:`get`'s, else one made for it."""
        found = self.get(state)
        if found is not None:
            return found
        rollout_id = state.get("rollout_id")
        if not rollout_id:
            raise GatewayConfigError(
                "this step needs the state of a gateway rollout: it has no rollout_id "
                "(rollout() sets it, with gateway_url; a state built by hand needs both)"
            )
        rollout = self._make(str(rollout_id))
        rollout.record.gateway_url = self._locate(state)
        rollout.record.register_sent = True  # may be registered: cancel and unregister go out
        return rollout

    def keep(self, rollout: GatewayRollout) -> None:
        """A direct ``register_rollout`` registered ``rollout``: keep it (and its key)."""
        if not self.is_running(rollout):
            self._kept[rollout.rollout_id] = rollout

    def forget(self, rollout: GatewayRollout) -> None:
        """``rollout`` is unregistered: a kept one is let go."""
        self._kept.pop(rollout.rollout_id, None)

    def clear(self) -> None:
        """The env is torn down: kept rollouts expire at the gateway's idle TTL."""
        self._kept.clear()


__all__ = ["StateRollouts", "current_rollout", "host_gateway_url", "shared_tunnel_url"]
