"""Async client for the rollout gateway's control plane.

One pooled ``httpx.AsyncClient`` per env; transient failures (connection errors,
timeouts, a pooled connection the server closed while idle, 429/502/503/504) are retried
with exponential backoff and jitter (tenacity); any other 4xx fails fast with the
gateway's own message. Every httpx error is translated into :mod:`rollout_gateway.errors`
in :meth:`GatewayClient._request`, and nowhere else.

A 401 or 403 means the gateway refused the admin token: a configuration error
(:class:`GatewayAuthError`, naming the setting), never retried. The client then stops
sending calls with that token: every later call raises the same error at once, so a
burst of rollouts meets it once, not once per rollout and retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar, cast
from urllib.parse import urlencode

import httpx
import orjson
import tenacity

from rollout_gateway import protocol
from rollout_gateway.errors import (
    GatewayAuthError,
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
        timeout: httpx timeout of the pooled client.
        limits: httpx connection limits of the pooled client.
        auth_help: what to set when the gateway refuses the admin token (ends the
            message of :class:`GatewayAuthError`).
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
        auth_help: str | None = None,
    ) -> None:
        self.base_url = protocol.gateway_root(base_url)
        self._root = self.base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        #: Whether the gateway accepts the admin token (calls wait for its first answer).
        self.access = AdminAccess(
            self.base_url,
            auth_help
            or (
                "pass the gateway's admin token (admin_token=...)"
                if admin_token
                else "the client sent no admin token: pass admin_token=..."
            ),
        )
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            timeout=timeout,
            limits=limits,
        )

    @property
    def auth_error(self) -> GatewayAuthError | None:
        """The gateway's refusal of the admin token, once seen (later calls raise it)."""
        return self.access.error

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

    async def check_admin_token(self) -> None:
        """Raise :class:`GatewayAuthError` if the gateway refuses this client's admin token.

        Asks for the trajectory of a fresh random rollout id, which a gateway of the
        protocol answers with 404 when the token is good and 401 when it is not (no
        side effect). Any other outcome (the gateway unreachable, an unexpected answer)
        proves nothing and is not raised: the calls that follow report it.
        """
        probe = protocol.new_rollout_id()
        try:
            await self._request_once("GET", protocol.trajectory_path(probe), probe)
        except GatewayError as e:
            logger.debug("gateway %s: admin token check inconclusive: %s", self.base_url, e)

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
        return _parsed(protocol.parse_register_response, data, rollout_id)

    async def get_trajectory(
        self, rollout_id: str, *, expand: bool = True
    ) -> protocol.TrajectoryResponse:
        """Fetch the recorded trajectory of a rollout (the protocol table's full form).

        It is asked for in the delta form, where each step holds only what the previous
        one does not (a 40-turn rollout at 32k context: 0.3 MB instead of 10 MB), and
        expanded here; a gateway without the delta form answers the full one. With
        ``expand=False`` a delta answer is returned as it came (``"format": "delta"``,
        see :func:`protocol.expand_delta_steps`), for readers that consume deltas.
        """
        data = await self._request(
            "GET",
            protocol.trajectory_path(_checked_id(rollout_id)),
            rollout_id,
            query=protocol.TRAJECTORY_DELTA_QUERY,
        )
        body = _parsed(protocol.parse_trajectory_response, data, rollout_id)
        steps = body.get("trajectory")
        if expand and data.pop("format", None) == "delta" and steps is not None:
            body["trajectory"] = _parsed(protocol.expand_delta_steps, steps, rollout_id)
        return body

    async def cancel(self, rollout_id: str) -> protocol.StatusResponse:
        """Cancel a rollout: the gateway refuses its later turns."""
        data = await self._request(
            "POST", protocol.cancel_path(_checked_id(rollout_id)), rollout_id
        )
        return _parsed(protocol.parse_status_response, data, rollout_id)

    async def unregister(self, rollout_id: str) -> protocol.StatusResponse:
        """Unregister a rollout and free its state on the gateway."""
        data = await self._request(
            "POST", protocol.unregister_path(_checked_id(rollout_id)), rollout_id
        )
        return _parsed(protocol.parse_status_response, data, rollout_id)

    async def wait_exits(self, after: int, timeout: float) -> protocol.ExitsResponse:
        """Agent exit reports numbered above ``after``, waiting up to ``timeout`` s for one.

        A gateway without the exit-report extension answers 404 or 405
        (:class:`GatewayRequestError`).
        """
        params = protocol.exits_query(after, timeout=timeout)
        data = await self._request_once("GET", protocol.EXITS_PATH, "", query=params)
        return _parsed(protocol.parse_exits_response, data, "")

    @contextlib.asynccontextmanager
    async def exit_feed(
        self, after: int, *, idle_timeout: float = protocol.EXIT_STREAM_IDLE_TIMEOUT
    ) -> AsyncIterator[ExitFeed]:
        """The exit stream from cursor ``after``: ``async with client.exit_feed(c) as feed``.

        One held connection; ``async for line in feed`` yields each report (and
        heartbeat) as the gateway sends it, and ends when the gateway ends the stream.
        A gateway that does not know the stream answers the plain long-poll instead
        (``feed.streamed`` is false, and the feed yields that answer's reports and
        cursor); one without it at all answers 404/405/400
        (:class:`GatewayRequestError`). Not retried: the caller reconnects from its
        cursor. A connection silent for ``idle_timeout`` s (no heartbeat; default
        :data:`protocol.EXIT_STREAM_IDLE_TIMEOUT`) fails with
        :class:`GatewayUnavailableError`.
        """
        path = protocol.EXITS_PATH
        request = self._http.build_request(
            "GET",
            self._url(path, protocol.exits_query(after, stream=True)),
            timeout=httpx.Timeout(idle_timeout, connect=_EXIT_STREAM_CONNECT_TIMEOUT),
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as e:
            raise _transport_error("GET", path, e, "") from e
        try:
            if response.status_code >= 400:
                try:
                    await response.aread()
                except httpx.TransportError as e:
                    raise _transport_error("GET", path, e, "") from e
                raise self._status_error("GET", path, response, "")
            feed = ExitFeed(response)
            try:
                yield feed
            finally:
                await feed.aclose()
        finally:
            await response.aclose()

    async def _request(self, method: str, path: str, rollout_id: str, **kwargs: Any) -> Any:
        """One control-plane call with the retry policy applied."""
        return await self.retry.call(
            lambda retried: self._request_once(method, path, rollout_id, **kwargs)
        )

    def _url(self, path: str, query: Mapping[str, str] | None = None) -> str:
        """The absolute URL of ``path`` with ``query``.

        httpx parses an absolute URL once; a path relative to ``base_url`` three times,
        and ``params=`` twice more (a third of the client's CPU per call, in a burst).
        Paths come from :mod:`protocol` and ids are checked, so nothing needs quoting.
        """
        url = self._root + path
        return f"{url}?{urlencode(query)}" if query else url

    async def _request_once(
        self,
        method: str,
        path: str,
        rollout_id: str,
        query: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One attempt (once :class:`AdminAccess` lets it go); translates every httpx
        failure into a typed error."""
        first = await self.access.enter()
        answered: int | None = None
        try:
            response = await self._http.request(method, self._url(path, query), **kwargs)
            answered = response.status_code
        except httpx.TransportError as e:
            raise _transport_error(method, path, e, rollout_id) from e
        finally:
            if first:
                self.access.answered(answered)
        status = response.status_code
        if status < 400:
            try:  # orjson: several times faster on a long trajectory than json
                return orjson.loads(response.content)
            except ValueError as e:
                raise GatewayProtocolError(
                    f"{method} {path}: answer is not JSON ({status})", rollout_id=rollout_id
                ) from e
        raise self._status_error(method, path, response, rollout_id)

    def _status_error(
        self, method: str, path: str, response: httpx.Response, rollout_id: str
    ) -> GatewayError | GatewayAuthError:
        """The typed error of an answer with an error status (read already)."""
        status = response.status_code
        if status in (401, 403):
            return self.access.refused(
                status, f"{method} {path}: {status} {_error_message(response)}"
            )
        message = f"{method} {path}: {status} {_error_message(response)}"
        if status in self.retry.retry_statuses:
            return GatewayUnavailableError(
                message, status_code=status, rollout_id=rollout_id, retryable=True
            )
        if status == 404:
            return RolloutNotFoundError(message, status_code=status, rollout_id=rollout_id)
        if status == 409:
            return RolloutConflictError(message, status_code=status, rollout_id=rollout_id)
        if 400 <= status < 500:
            return GatewayRequestError(message, status_code=status, rollout_id=rollout_id)
        return GatewayUnavailableError(message, status_code=status, rollout_id=rollout_id)


class AdminAccess:
    """Whether a gateway accepts a client's admin token.

    Until the gateway has answered one call without refusing the token, calls go one at
    a time: a refused token then fails the first call, and every call waiting behind it
    (and every later one) raises the same :class:`GatewayAuthError` without being sent,
    so a burst of rollouts meets a misconfiguration once, not once per rollout.

    Args:
        base_url: the gateway's root (named in the error).
        auth_help: what to set (ends the error's message).
    """

    def __init__(self, base_url: str, auth_help: str) -> None:
        self.base_url = base_url
        self.auth_help = auth_help
        #: The gateway's refusal of the admin token, once seen.
        self.error: GatewayAuthError | None = None
        #: Whether the gateway answered a call without refusing the token.
        self._confirmed = False
        #: The first call in flight while access is unconfirmed (others wait for it).
        self._first_call: asyncio.Future[None] | None = None

    async def enter(self) -> bool:
        """Wait until a call may go; whether it goes first (then tell :meth:`answered`).
        Raises the refusal once the token was refused."""
        while not self._confirmed:
            if self.error is not None:
                raise self._error_copy()
            if self._first_call is None:
                break
            await asyncio.shield(self._first_call)
        if self.error is not None:
            raise self._error_copy()
        first = not self._confirmed
        if first:
            self._first_call = asyncio.get_running_loop().create_future()
        return first

    def answered(self, status: int | None) -> None:
        """The first call's answer: one that is not a refusal confirms the token; none (a
        transport failure, a cancellation) lets the next call go first."""
        self._confirmed = status is not None and status not in (401, 403)
        gate, self._first_call = self._first_call, None
        if gate is not None and not gate.done():
            gate.set_result(None)

    def refused(self, status: int, what: str) -> GatewayAuthError:
        """The gateway refused the token with ``status`` (``what``: the call and its
        answer): remember it, say it once in the log."""
        if self.error is None:
            self.error = GatewayAuthError(
                f"the rollout gateway at {self.base_url} refused the control plane ({what}); "
                f"{self.auth_help}",
                status_code=status,
                gateway_url=self.base_url,
            )
            logger.error("%s", self.error)
        return self._error_copy()

    def _error_copy(self) -> GatewayAuthError:
        # A fresh instance per raise: rollouts raise it concurrently, each with its own
        # traceback.
        seen = self.error
        assert seen is not None
        return GatewayAuthError(
            str(seen), status_code=seen.status_code, gateway_url=seen.gateway_url
        )


_EXIT_STREAM_CONNECT_TIMEOUT = 10.0


class ExitFeed:
    """The lines of one exit stream (see :meth:`GatewayClient.exit_feed`).

    ``streamed`` is false when the gateway answered the plain long-poll instead: the
    feed then yields that answer's reports and a heartbeat with its cursor, and ends.
    Failures are typed: a broken or silent connection is :class:`GatewayUnavailableError`,
    a line that is not the protocol's :class:`GatewayProtocolError`.
    """

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        media_type = response.headers.get("content-type", "").partition(";")[0].strip()
        #: Whether the gateway streams (else it answered the long-poll).
        self.streamed = media_type.lower() == protocol.EXIT_STREAM_MEDIA_TYPE
        self._lines: AsyncGenerator[protocol.ExitStreamLine, None] | None = None

    def __aiter__(self) -> AsyncIterator[protocol.ExitStreamLine]:
        if self._lines is None:
            self._lines = self._read()
        return self._lines

    async def aclose(self) -> None:
        """Close the line reader (the context of :meth:`GatewayClient.exit_feed` does)."""
        if self._lines is not None and not getattr(self._lines, "ag_running", False):
            await self._lines.aclose()

    async def _read(self) -> AsyncGenerator[protocol.ExitStreamLine, None]:
        path = protocol.EXITS_PATH
        try:
            if not self.streamed:
                for line in _long_poll_lines(await self._response.aread()):
                    yield line
                return
            pending = b""
            async for chunk in self._response.aiter_bytes():
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                if len(pending) > protocol.EXIT_STREAM_MAX_LINE:
                    raise GatewayProtocolError(f"GET {path}: exit stream line too long")
                for raw in lines:
                    if raw.strip():
                        yield _stream_line(raw)
            if pending.strip():
                yield _stream_line(pending)
        except httpx.TransportError as e:
            raise _transport_error("GET", path, e, "") from e


def _stream_line(raw: bytes) -> protocol.ExitStreamLine:
    try:
        return protocol.parse_exit_stream_line(raw)
    except ValueError as e:
        raise GatewayProtocolError(f"GET {protocol.EXITS_PATH}: bad exit stream line: {e}") from e


def _long_poll_lines(content: bytes) -> list[protocol.ExitStreamLine]:
    """A long-poll answer as stream lines: its reports, then its cursor."""
    try:
        body = orjson.loads(content)
    except ValueError as e:
        raise GatewayProtocolError(f"GET {protocol.EXITS_PATH}: answer is not JSON") from e
    answer = _parsed(protocol.parse_exits_response, body, "")
    lines: list[protocol.ExitStreamLine] = list(answer["exits"])
    lines.append({"cursor": answer["cursor"]})
    return lines


def _transport_error(
    method: str, path: str, error: httpx.TransportError, rollout_id: str
) -> GatewayUnavailableError:
    # Connection refused/reset, timeouts, and a keep-alive connection the server closed
    # while idle (ReadError / RemoteProtocolError): all safe to retry.
    return GatewayUnavailableError(
        f"{method} {path}: {type(error).__name__}: {error}",
        rollout_id=rollout_id,
        retryable=True,
    )


def _checked_id(rollout_id: str) -> str:
    if not protocol.is_valid_rollout_id(rollout_id):
        raise ValueError(
            f"invalid rollout id {rollout_id!r}: must match {protocol.ROLLOUT_ID_RE.pattern}"
        )
    return rollout_id


def _parsed(parse: Callable[[Any], T], data: Any, rollout_id: str) -> T:
    """``data`` read by a parser of :mod:`rollout_gateway.protocol` (an answer that is
    not the protocol's is the gateway's fault: :class:`GatewayProtocolError`)."""
    try:
        return parse(data)
    except protocol.BodyError as e:
        raise GatewayProtocolError(str(e), rollout_id=rollout_id) from None


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
    "AdminAccess",
    "ExitFeed",
    "GatewayClient",
    "RetryPolicy",
]
