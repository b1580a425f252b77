"""Gateway-mode settings: one object, one name per option.

Every stack adapter (the verifiers 0.3 mixin, the verifiers v1 interception) reads its
options from a :class:`GatewaySettings`. It is plain data plus a few seams (an httpx
transport, a tunnel provider, a clock and a sleep) that tests and benchmarks replace.
A mapping of the same names (e.g. from ``vf-eval -a '{"gateway": {...}}'``) is accepted
wherever settings are, through :meth:`GatewaySettings.coerce`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollout_gateway import protocol
from rollout_gateway.admin_token import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_FILE_ENV,
    admin_token_source,
    discard_admin_token_variables,
    take_admin_token,
)
from rollout_gateway.client import RetryPolicy
from rollout_gateway.errors import GatewayConfigError
from rollout_gateway.polling import PollPolicy
from rollout_gateway.tunnels import (
    DirectTunnelProvider,
    PrimeTunnelProvider,
    TunnelProvider,
)

#: How long an agent may run by default (the earlier experimental mixin's default: 6 h).
DEFAULT_AGENT_TIMEOUT = 21600.0
TUNNEL_PROVIDERS = ("prime", "direct")


@dataclass(frozen=True)
class GatewaySettings:
    """How an env talks to the rollout gateway and watches its agents.

    Attributes:
        gateway_url: gateway root to use instead of the one derived from the model
            client's base URL (``/v1`` stripped).
        gateway_port: port of the gateway when its URL names none.
        agent_timeout: seconds an agent may run before it is stopped and the rollout
            ends with stop condition ``agent_timeout``; ``None`` means no limit (the
            env's own rollout timeout still applies).
        tunnel_provider: ``"prime"``, ``"direct"``, a :class:`TunnelProvider`, or
            ``None`` for the adapter's default (direct for local sandboxes, else prime).
        admin_token: control-plane bearer token; ``None`` reads the file named by
            ``$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE``, else the ``admin_token_env`` variable.
        admin_token_env: name of the environment variable holding the admin token. The
            variables are removed from the process's environment once read (also when
            ``admin_token`` is given), so that nothing it starts later inherits them.
        retry: retry policy of control-plane calls (or a mapping of its fields).
        poll: how often to ask the sandbox whether the agent exited (or a mapping of
            its fields).
        tunnel_health_check_interval: seconds between server-side checks of a tunnel.
        tunnel_liveness_interval: seconds between the tunnel monitor's process checks.
        agent_stop_grace: seconds to wait for a stopped agent's job to report its exit.
        finalize_step_timeout: bound of each teardown step (scoring, cancel, unregister,
            sandbox delete...), so one hung step cannot keep a rollout forever.
        exit_reports: let the agent's launch wrapper report its exit to the gateway and
            wait on the gateway's exit long-poll, polling sandboxes only as a safety net
            (falls back to polling by itself when the gateway lacks the extension).
        allow_empty_trajectory: keep a rollout whose agent made no model call as a
            zero-turn rollout instead of failing it with ``EmptyTrajectoryError``.
        transport: httpx transport of the control-plane client (a seam for tests).
        clock: monotonic clock in seconds (a seam for tests).
        sleep: the waits of polling and the tunnel monitor (a seam for tests).

    Every field is checked at construction: an invalid value raises
    :class:`GatewayConfigError` naming the field.
    """

    gateway_url: str | None = None
    gateway_port: int = 8000
    agent_timeout: float | None = DEFAULT_AGENT_TIMEOUT
    tunnel_provider: TunnelProvider | str | None = None
    admin_token: str | None = field(default=None, repr=False)
    admin_token_env: str = ADMIN_TOKEN_ENV
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    poll: PollPolicy = field(default_factory=PollPolicy)
    tunnel_health_check_interval: float = 30.0
    tunnel_liveness_interval: float = 1.0
    agent_stop_grace: float = 5.0
    finalize_step_timeout: float = 600.0
    exit_reports: bool = True
    allow_empty_trajectory: bool = False
    transport: httpx.AsyncBaseTransport | None = field(default=None, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)
    sleep: Callable[[float], Awaitable[None]] = field(
        default=asyncio.sleep, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        # Every field is checked here, so settings from a mapping (``vf-eval -a`` JSON)
        # fail at construction naming the field, not mid-rollout (a string "false" for
        # a flag would otherwise be taken as true).
        if isinstance(self.gateway_port, bool) or not isinstance(self.gateway_port, int):
            raise GatewayConfigError(f"gateway_port must be an integer, got {self.gateway_port!r}")
        if not 0 < self.gateway_port < 65536:
            raise GatewayConfigError(f"gateway_port out of range: {self.gateway_port}")
        if self.gateway_url is not None:
            if not isinstance(self.gateway_url, str) or not self.gateway_url.startswith(
                ("http://", "https://")
            ):
                raise GatewayConfigError(
                    f"gateway_url must be an http(s) URL, got {self.gateway_url!r}"
                )
            object.__setattr__(self, "gateway_url", protocol.gateway_root(self.gateway_url))
        if self.agent_timeout is not None and not _is_number(self.agent_timeout, positive=True):
            raise GatewayConfigError(
                f"agent_timeout must be a positive number of seconds or None, "
                f"got {self.agent_timeout!r}"
            )
        if isinstance(self.tunnel_provider, str):
            if self.tunnel_provider not in TUNNEL_PROVIDERS:
                raise GatewayConfigError(
                    f"tunnel_provider must be one of {TUNNEL_PROVIDERS} or a TunnelProvider, "
                    f"got {self.tunnel_provider!r}"
                )
        elif self.tunnel_provider is not None and not isinstance(
            self.tunnel_provider, TunnelProvider
        ):
            raise GatewayConfigError(
                f"tunnel_provider must be one of {TUNNEL_PROVIDERS} or a TunnelProvider, "
                f"got {type(self.tunnel_provider).__name__}"
            )
        if self.admin_token is not None and not isinstance(self.admin_token, str):
            raise GatewayConfigError("admin_token must be a string or None")
        if not isinstance(self.admin_token_env, str):  # "" reads no variable: no token
            raise GatewayConfigError(
                f"admin_token_env must be a variable name, got {self.admin_token_env!r}"
            )
        object.__setattr__(self, "retry", _policy("retry", self.retry, RetryPolicy))
        object.__setattr__(self, "poll", _policy("poll", self.poll, PollPolicy))
        for name in (
            "tunnel_health_check_interval",
            "tunnel_liveness_interval",
            "finalize_step_timeout",
        ):
            value = getattr(self, name)
            if not _is_number(value, positive=True):
                raise GatewayConfigError(f"{name} must be a positive finite number, got {value!r}")
        if not _is_number(self.agent_stop_grace, positive=False):
            raise GatewayConfigError(
                f"agent_stop_grace must be a non-negative finite number, "
                f"got {self.agent_stop_grace!r}"
            )
        for name in ("exit_reports", "allow_empty_trajectory"):
            if not isinstance(getattr(self, name), bool):
                raise GatewayConfigError(
                    f"{name} must be true or false, got {getattr(self, name)!r}"
                )

    @classmethod
    def coerce(cls, value: GatewaySettings | Mapping[str, Any] | None) -> GatewaySettings:
        """``value`` as settings: settings as they are, a mapping by field name."""
        if value is None:
            return cls()
        if isinstance(value, GatewaySettings):
            return value
        if isinstance(value, Mapping):
            return cls().replace(**value)
        raise GatewayConfigError(
            f"gateway settings must be GatewaySettings or a mapping, got {type(value).__name__}"
        )

    def replace(self, **changes: Any) -> GatewaySettings:
        """A copy with ``changes`` applied (unknown names are a :class:`GatewayConfigError`)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise GatewayConfigError(
                f"unknown gateway setting(s) {unknown}; known: {sorted(names)}"
            )
        return dataclasses.replace(self, **changes)

    def resolve_gateway_url(self, client_base_url: object, *, how_to_set: str) -> str:
        """The gateway root: ``gateway_url``, else the model client's base URL minus ``/v1``.

        ``how_to_set`` names, in the error, how the adapter's user sets ``gateway_url``.
        """
        if self.gateway_url:
            return self.gateway_url
        if not client_base_url:
            raise GatewayConfigError(
                f"cannot derive the gateway URL: the model client has no base_url; {how_to_set}"
            )
        url = protocol.gateway_root(str(client_base_url))
        if not url.startswith(("http://", "https://")):
            raise GatewayConfigError(f"model client base URL {client_base_url!r} is not http(s)")
        return url

    def resolved_admin_token(self) -> str | None:
        """The admin token: ``admin_token``, else the file named by
        ``$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE``, else the ``admin_token_env`` variable.

        Read once with :func:`rollout_gateway.admin_token.take_admin_token`: the variables
        leave ``os.environ`` (no agent started later inherits them), the token stays in
        memory. Raises :class:`GatewayConfigError` naming the variable when that file
        cannot be read.
        """
        if self.admin_token:
            discard_admin_token_variables(self.admin_token_env)
            return self.admin_token
        return take_admin_token(self.admin_token_env)

    def admin_token_help(self) -> str:
        """What to set when the gateway refuses the token: where this env took it from."""
        if self.admin_token:
            gave: str | None = "the admin token of GatewaySettings.admin_token"
        else:
            try:
                take_admin_token(self.admin_token_env)
            except GatewayConfigError:
                pass  # resolved_admin_token() reports it
            gave = admin_token_source(self.admin_token_env)
        where = (
            f"set ${ADMIN_TOKEN_FILE_ENV} to the gateway's token file (the file of "
            f"`rollout-gateway serve --admin-token-file`), or ${self.admin_token_env} to "
            "the token itself"
        )
        if gave is None:
            return f"the env sent no admin token: {where}"
        return f"{gave} is not the gateway's: {where}"

    def resolved_tunnel_provider(self, *, local: bool) -> TunnelProvider:
        """The tunnel provider; ``local`` picks the default (direct when sandboxes are local)."""
        provider = self.tunnel_provider
        if provider is None:
            provider = "direct" if local else "prime"
        if provider == "direct":
            return DirectTunnelProvider()
        if provider == "prime":
            return PrimeTunnelProvider()
        assert not isinstance(provider, str)
        return provider


def _is_number(value: object, *, positive: bool) -> bool:
    """A finite int or float (not a bool), > 0 when ``positive`` else >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and (value > 0 if positive else value >= 0)


def _policy(name: str, value: object, cls: type[Any]) -> Any:
    """``value`` as a ``cls`` (a mapping of its fields is built into one), naming ``name``."""
    if isinstance(value, Mapping):
        try:
            return cls(**value)
        except (TypeError, ValueError) as e:
            raise GatewayConfigError(f"{name}: {e}") from e
    if not isinstance(value, cls):
        raise GatewayConfigError(
            f"{name} must be a {cls.__name__} or a mapping of its fields, "
            f"got {type(value).__name__}"
        )
    return value


__all__ = ["ADMIN_TOKEN_ENV", "DEFAULT_AGENT_TIMEOUT", "GatewaySettings", "TUNNEL_PROVIDERS"]
