"""Async client for the rollout gateway's control plane.

One pooled ``httpx.AsyncClient`` per env; transient failures (connection errors,
timeouts, a pooled connection the server closed while idle, 429/502/503/504) are retried
with exponential backoff and jitter (tenacity); any other 4xx fails fast with the
gateway's own message. Every httpx error is translated into :mod:`rollout_gateway.errors`
in :meth:`GatewayClient._request`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import httpx
import orjson
import tenacity

from rollout_gateway import protocol
from rollout_gateway.errors import (
    GatewayError,
    GatewayProtocolError,
    GatewayRequestError,
    GatewayUnavailableError,
    RolloutConflictError,
    RolloutNotFoundError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Request bodies are encoded with orjson (a burst registers hundreds at once).
_JSON_CONTENT = {"Content-Type": "application/json"}

#: Statuses worth another attempt: the gateway (or a proxy in front of it) is busy.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to retry a control-plane call (data, like tenacity's policies).

    ``max_attempts`` counts the first try. Waits grow exponentially from
    ``initial_backoff`` up to ``max_backoff`` seconds, plus up to ``jitter`` seconds of
    random jitter so a burst of rollouts does not retry in lockstep.
    """

    max_attempts: int = 6
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    jitter: float = 0.2
    retry_statuses: frozenset[int] = field(default=RETRYABLE_STATUSES)
    #: How to wait between attempts (a seam: tests pass a fake sleep, no real waiting).
    sleep: Callable[[float], Awaitable[None]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.jitter < 0:
            raise ValueError("RetryPolicy waits must be non-negative")

    def retrying(self, *, after: int = 0) -> tenacity.AsyncRetrying:
        """A fresh tenacity controller retrying only transient :class:`GatewayError`.

        ``after`` attempts already failed (and their waits were slept): the controller
        then runs the remaining attempts with the waits that follow.
        """
        extra: dict[str, Any] = {"sleep": self.sleep} if self.sleep is not None else {}
        return tenacity.AsyncRetrying(
            **extra,
            stop=tenacity.stop_after_attempt(self.max_attempts - after),
            wait=tenacity.wait_exponential_jitter(
                initial=self.initial_backoff * 2**after, max=self.max_backoff, jitter=self.jitter
            ),
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, GatewayError) and e.retryable
            ),
            reraise=True,
        )

    def backoff(self, failures: int) -> float:
        """The wait after ``failures`` failed attempts (tenacity's exponential jitter)."""
        return tenacity.wait_exponential_jitter(
            initial=self.initial_backoff * 2 ** (failures - 1),
            max=self.max_backoff,
            jitter=self.jitter,
        )(_FIRST_RETRY_STATE)

    async def call(self, attempt: Callable[[bool], Awaitable[T]]) -> T:
        """``attempt(retried)`` under this policy.

        The first try runs without tenacity's machinery (nearly every control-plane call
        succeeds at once, and a burst of rollouts makes thousands of them); only after
        a transient failure does the tenacity controller take over.
        """
        try:
            return await attempt(False)
        except GatewayError as e:
            if not e.retryable or self.max_attempts == 1:
                raise
        await (self.sleep or asyncio.sleep)(self.backoff(1))
        async for try_ in self.retrying(after=1):
            with try_:
                return await attempt(True)
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover


#: tenacity's wait strategies read only the attempt number (1: the first wait).
_FIRST_RETRY_STATE = cast(tenacity.RetryCallState, SimpleNamespace(attempt_number=1))


#: Connect fast, but let a trajectory of a long rollout take its time to come back.
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
#: Hundreds of rollouts register at once at a step boundary.
DEFAULT_LIMITS = httpx.Limits(max_connections=512, max_keepalive_connections=128)


class GatewayClient:
    """Control-plane client of one rollout gateway (register, trajectory, cancel, unregister).

    Args:
        base_url: the gateway root (``http://host:port``, no ``/v1``).
        admin_token: bearer token for the control plane, when the gateway requires one.
        retry: the :class:`RetryPolicy`.
        transport: an httpx transport (tests inject ``httpx.MockTransport`` or respx).
        timeout, limits: httpx settings of the pooled client.
    """

    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str | None = None,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ) -> None:
        self.base_url = protocol.gateway_root(base_url)
        self.retry = retry or RetryPolicy()
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            timeout=timeout,
            limits=limits,
        )

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._http.is_closed

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent."""
        if not self._http.is_closed:
            await self._http.aclose()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def register(
        self,
        rollout_id: str,
        *,
        model: str,
        sampling_params: dict[str, Any] | None = None,
        max_turns: int = protocol.UNLIMITED_TURNS,
        max_seq_len: int | None = None,
        api_key: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> protocol.RegisterResponse:
        """Register a rollout. Returns the gateway's answer (with ``api_key`` if it issues one).

        ``api_key`` proposes the rollout's data-plane key (see
        :func:`protocol.new_rollout_api_key`): a gateway that honours it uses it, so the
        key is known even when the answer is lost. A 409 on a *retried* attempt means an
        earlier attempt landed (the id is ours and unguessable), so it counts as success;
        the answer is then rebuilt from the request, with the proposed key.
        ``extra`` adds optional protocol fields to the body (e.g. verifiers v1's limits).
        """
        body = protocol.register_request(
            model=model,
            sampling_params=sampling_params,
            max_turns=max_turns,
            max_seq_len=max_seq_len,
            api_key=api_key,
            extra=extra,
        )
        path = protocol.register_path(_checked_id(rollout_id))
        content = orjson.dumps(body)

        async def attempt(retried: bool) -> Any:
            try:
                return await self._request_once(
                    "POST", path, rollout_id, content=content, headers=_JSON_CONTENT
                )
            except RolloutConflictError:
                if not retried:
                    raise
                logger.info("rollout=%s register retried: already registered", rollout_id)
                return None

        data = await self.retry.call(attempt)
        if data is None:  # an earlier attempt landed: its answer was lost
            return protocol.register_response(rollout_id, body)
        response = cast(protocol.RegisterResponse, _require_dict(data, "register", rollout_id))
        answered_key = response.get("api_key")
        if answered_key is not None and not isinstance(answered_key, str):
            raise GatewayProtocolError(
                "register answered a non-string api_key", rollout_id=rollout_id
            )
        return response

    async def get_trajectory(self, rollout_id: str) -> protocol.TrajectoryResponse:
        """Fetch the recorded trajectory of a rollout (the protocol table's full form).

        It is asked for in the delta form, where each step holds only what the previous
        one does not (a 40-turn rollout at 32k context: 0.3 MB instead of 10 MB), and
        expanded here; a gateway without the delta form answers the full one.
        """
        data = await self._request(
            "GET",
            protocol.trajectory_path(_checked_id(rollout_id)),
            rollout_id,
            params=protocol.TRAJECTORY_DELTA_QUERY,
        )
        body = _require_dict(data, "trajectory", rollout_id)
        steps = body.get("trajectory")
        if steps is not None and not isinstance(steps, list):
            raise GatewayProtocolError(
                "trajectory answer: 'trajectory' is not a list", rollout_id=rollout_id
            )
        if body.pop("format", None) == "delta" and steps is not None:
            try:
                body["trajectory"] = protocol.expand_delta_steps(steps)
            except (KeyError, TypeError, IndexError) as e:
                raise GatewayProtocolError(
                    f"trajectory answer: malformed delta step ({type(e).__name__}: {e})",
                    rollout_id=rollout_id,
                ) from e
        return cast(protocol.TrajectoryResponse, body)

    async def cancel(self, rollout_id: str) -> protocol.StatusResponse:
        """Cancel a rollout: the gateway refuses its later turns."""
        data = await self._request(
            "POST", protocol.cancel_path(_checked_id(rollout_id)), rollout_id
        )
        return cast(protocol.StatusResponse, _require_dict(data, "cancel", rollout_id))

    async def unregister(self, rollout_id: str) -> protocol.StatusResponse:
        """Unregister a rollout and free its state on the gateway."""
        data = await self._request(
            "POST", protocol.unregister_path(_checked_id(rollout_id)), rollout_id
        )
        return cast(protocol.StatusResponse, _require_dict(data, "unregister", rollout_id))

    async def wait_exits(self, after: int, timeout: float) -> protocol.ExitsResponse:
        """Agent exit reports numbered above ``after``, waiting up to ``timeout`` s for one.

        A gateway without the exit-report extension answers 404 or 405
        (:class:`GatewayRequestError`).
        """
        params = {"after": str(after), "timeout": f"{timeout:g}"}
        data = await self._request_once("GET", protocol.EXITS_PATH, "", params=params)
        body = _require_dict(data, "exits", "")
        if not isinstance(body.get("exits"), list) or not isinstance(body.get("cursor"), int):
            raise GatewayProtocolError("exits answer lacks 'exits' or 'cursor'")
        return cast(protocol.ExitsResponse, body)

    async def _request(self, method: str, path: str, rollout_id: str, **kwargs: Any) -> Any:
        """One control-plane call with the retry policy applied."""
        return await self.retry.call(
            lambda retried: self._request_once(method, path, rollout_id, **kwargs)
        )

    async def _request_once(self, method: str, path: str, rollout_id: str, **kwargs: Any) -> Any:
        """One attempt; translates every httpx failure into a typed error."""
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            # Connection refused/reset, timeouts, and a keep-alive connection the server
            # closed while idle (ReadError / RemoteProtocolError): all safe to retry.
            raise GatewayUnavailableError(
                f"{method} {path}: {type(e).__name__}: {e}",
                rollout_id=rollout_id,
                retryable=True,
            ) from e
        status = response.status_code
        if status < 400:
            try:  # orjson: several times faster on a long trajectory than json
                return orjson.loads(response.content)
            except ValueError as e:
                raise GatewayProtocolError(
                    f"{method} {path}: answer is not JSON ({status})", rollout_id=rollout_id
                ) from e
        message = f"{method} {path}: {status} {_error_message(response)}"
        if status in self.retry.retry_statuses:
            raise GatewayUnavailableError(
                message, status_code=status, rollout_id=rollout_id, retryable=True
            )
        if status == 404:
            raise RolloutNotFoundError(message, status_code=status, rollout_id=rollout_id)
        if status == 409:
            raise RolloutConflictError(message, status_code=status, rollout_id=rollout_id)
        if 400 <= status < 500:
            raise GatewayRequestError(message, status_code=status, rollout_id=rollout_id)
        raise GatewayUnavailableError(message, status_code=status, rollout_id=rollout_id)


def _checked_id(rollout_id: str) -> str:
    if not protocol.is_valid_rollout_id(rollout_id):
        raise ValueError(
            f"invalid rollout id {rollout_id!r}: must match {protocol.ROLLOUT_ID_RE.pattern}"
        )
    return rollout_id


def _require_dict(data: Any, what: str, rollout_id: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise GatewayProtocolError(f"{what} answer is not a JSON object", rollout_id=rollout_id)
    return data


def _error_message(response: httpx.Response) -> str:
    """The gateway's own message: ``{"error": {"message"}}``, ``{"detail"}`` or the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in data:
            return str(data["detail"])
    return response.text[:500]


__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_TIMEOUT",
    "RETRYABLE_STATUSES",
    "GatewayClient",
    "RetryPolicy",
]
