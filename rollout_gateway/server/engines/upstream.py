"""Upstream inference servers: rollout pinning, health, error mapping, the calls in flight.

Each upstream's HTTP client is an :class:`~.upstream_http1.Http1Upstream` (its calls go
through httpx when a test injects a transport). Every call to an upstream, whole
(:meth:`UpstreamPool.post`) or streamed (the engine turn's), runs in ``with
upstream.call:`` (:class:`UpstreamCall`), the one place that counts it in flight and
classifies a failure to get an answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import httpx

from rollout_gateway.server.engines.upstream_http import (
    ConnectionFailureKind,
    HTTPAnswer,
    RequestContent,
)
from rollout_gateway.server.engines.upstream_http1 import Http1Upstream
from rollout_gateway.server.http import jsonio

logger = logging.getLogger("rollout_gateway.server")

ErrorKind = Literal["connect", "timeout", "transport", "http_4xx", "http_5xx", "protocol"]


class UpstreamError(Exception):
    """An upstream call failed; ``status_code`` is what the gateway answers the agent.

    ``message`` is what the agent sees: short, with no upstream URL, credential or
    exception repr. ``detail`` is for the operator's log only.
    """

    def __init__(
        self,
        kind: ErrorKind,
        status_code: int,
        message: str,
        detail: str = "",
        *,
        upstream_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status_code = status_code
        self.message = message
        self.detail = detail or message
        #: The engine's own HTTP status, for an error answer (the failed turn records it).
        self.upstream_status = upstream_status


#: What the agent and the operator are told when the connection to an upstream fails.
_CONNECTION_FAILURES: dict[str, tuple[str, str]] = {
    "connect": ("upstream unreachable", "unreachable"),
    "timeout": ("upstream timed out", "timed out"),
    "transport": ("upstream connection failed", "failed"),
}


def connection_failure(
    kind: ConnectionFailureKind, label: str, exc: BaseException
) -> UpstreamError:
    """The :class:`UpstreamError` of a failed connection to the upstream ``label``:
    ``connect``, ``timeout`` or ``transport`` (one wording for every upstream call)."""
    message, detail = _CONNECTION_FAILURES[kind]
    return UpstreamError(kind, 502, message, f"{label} {detail}: {exc!r}")


def redact_url(url: str) -> str:
    """``url`` without credentials, query or fragment (safe for logs, metrics, health)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class UpstreamCall:
    """``with upstream.call:`` around one call to an upstream, whole or streamed (then
    around the reading of the answer too): counted in flight while it runs, and a failure
    to get the answer raised as the one classification of :meth:`Upstream.connection_failure`
    (other errors pass as they are). One per upstream, holding no state of a call."""

    __slots__ = ("upstream",)

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def __enter__(self) -> None:
        self.upstream.in_flight += 1

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.upstream.in_flight -= 1
        if exc is not None and isinstance(exc, Exception):
            failure = self.upstream.connection_failure(exc)
            if failure is not None:
                raise failure from exc


@dataclass(eq=False)
class Upstream:
    """One inference server (OpenAI base URL) and its HTTP client."""

    base_url: str
    http: Http1Upstream
    label: str = field(default="")  # base_url without credentials (metrics, logs, health)
    healthy: bool = True
    pinned: int = 0  # registered rollouts pinned here
    in_flight: int = 0  # chat requests under way (counted by ``call``)

    def __post_init__(self) -> None:
        self.label = self.label or redact_url(self.base_url)
        #: ``with upstream.call:`` around each call to it (see :class:`UpstreamCall`).
        self.call = UpstreamCall(self)

    def connection_failure(self, exc: BaseException) -> UpstreamError | None:
        """The :class:`UpstreamError` of ``exc`` raised by a call to this upstream, when
        it is a connection failure (one classification for every call path); a failure
        to connect marks the upstream unhealthy."""
        kind = self.http.failure_kind(exc)
        if kind is None:
            return None
        if kind == "connect":
            if self.healthy:
                logger.warning("upstream=%s marked unhealthy: %r", self.label, exc)
            self.healthy = False
        return connection_failure(kind, self.label, exc)

    def answered(self) -> None:
        """The upstream answered a call: it is reachable."""
        if not self.healthy:
            logger.info("upstream=%s healthy again", self.label)
        self.healthy = True

    @property
    def load(self) -> tuple[int, int]:
        """Sort key of the least-loaded choice."""
        return (self.pinned, self.in_flight)


def _upstream_message(response: HTTPAnswer) -> str:
    """What an error answer says, whatever its form (for the operator's log)."""
    return _engine_error_message(response) or response.text[:2000] or response.reason


def _engine_error_message(response: HTTPAnswer) -> str | None:
    """The error message an OpenAI-compatible server put in its JSON answer, if any
    (``None`` for anything else: a proxy's HTML page, plain text, an odd JSON shape)."""
    try:
        body = jsonio.loads_lenient(response.content)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
        return clean_text(error["message"])
    if isinstance(error, str) and error:
        return clean_text(error)
    for key in ("message", "detail"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return clean_text(value)
        if isinstance(value, list):  # FastAPI's validation errors: their "msg"s, no repr
            texts = [
                e["msg"] for e in value if isinstance(e, dict) and isinstance(e.get("msg"), str)
            ]
            if texts:
                return clean_text("; ".join(texts))
    return None


def clean_text(text: str) -> str:
    """An upstream's text made writable as JSON: lone surrogates (which the lenient parser
    lets through, and orjson refuses to write) become ``?``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def agent_status(upstream_status: int) -> int:
    """The status an agent gets for an engine's error status: 502 for a 5xx; 400 for a
    4xx, except 404 (an unknown model stays "not found") and 429 (kept so clients back
    off). Whole answers and errors inside a stream map alike."""
    if upstream_status >= 500:
        return 502
    return upstream_status if upstream_status in (404, 429) else 400


def raise_for_upstream_status(response: HTTPAnswer, label: str) -> None:
    """Raise the :class:`UpstreamError` an error answer maps to (nothing below 400).

    5xx -> 502 with a short message; 4xx -> the engine's own message with 400, except
    404 (an unknown model name stays "not found") and 429 (kept so clients back off).
    Only a message the engine put in a JSON error reaches the agent: anything else (a
    proxy's HTML page naming hosts and versions, plain text) is ``upstream error <status>``.
    ``label`` (the redacted upstream URL) and the whole answer go to the operator-only
    ``detail``.
    """
    status = response.status_code
    if status >= 500:
        raise UpstreamError(
            "http_5xx",
            agent_status(status),
            f"upstream error {status}",
            f"{label} answered {status}: {_upstream_message(response)}",
            upstream_status=status,
        )
    if status >= 400:
        message = (_engine_error_message(response) or f"upstream error {status}")[:2000]
        detail = f"{label} answered {status}: {_upstream_message(response)}"
        raise UpstreamError(
            "http_4xx", agent_status(status), message, detail, upstream_status=status
        )


def parse_completion(raw: bytes) -> tuple[dict[str, Any], bool]:
    """An upstream's chat completion; ``(completion, strict)``.

    ``strict`` is false when the answer needed the lenient parser (``NaN``/``Infinity``
    literals): it must then not be passed to an agent as it is. Raises
    :class:`UpstreamError` (502) when it is not JSON or not a chat completion.
    """
    strict = True
    try:
        completion = jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        strict = False
        try:
            completion = jsonio.loads_lenient(raw)
        except (ValueError, RecursionError) as exc:
            raise UpstreamError(
                "protocol", 502, "upstream answered non-JSON", f"unparsable answer: {exc!r}"
            ) from exc
    if not isinstance(completion, dict) or not isinstance(completion.get("choices"), list):
        raise UpstreamError("protocol", 502, "upstream answer is not a chat completion")
    if not strict:
        check_answer_writable(completion)
    else:
        # The strict parser builds only values JSON can carry, but reads 1024 levels where
        # the gateway writes 254: what it keeps of an answer (each choice's message, the
        # usage) must be writable where it keeps it. (The rest is only relayed: an answer
        # too deep for that is a 502 when it is written, see agents/chat.py.)
        kept = [c.get("message") for c in completion["choices"] if isinstance(c, dict)]
        kept.append(completion.get("usage"))
        try:
            jsonio.check_depth(kept, jsonio.MAX_KEPT_ANSWER_DEPTH)
        except jsonio.TooDeepError as exc:
            raise malformed_answer(f"nests too deep: {exc}") from None
    return completion, strict


def malformed_answer(detail: str) -> UpstreamError:
    """The error of an upstream answer the gateway cannot read (the upstream's fault)."""
    return UpstreamError("protocol", 502, "upstream answer is malformed", detail)


def check_answer_writable(value: Any) -> None:
    """Raise the 502 :class:`UpstreamError` of :func:`malformed_answer` unless ``value``
    (parsed from an upstream) can be written back as JSON wherever the gateway keeps it:
    no integer beyond 64 bits, no lone surrogate, no nesting deeper than the gateway
    allows (:func:`~rollout_gateway.server.http.jsonio.check_writable`)."""
    try:
        jsonio.check_writable(value)
    except jsonio.UnwritableError as exc:
        raise malformed_answer(f"a value JSON cannot carry back: {exc}") from None


class UpstreamPool:
    """The gateway's upstreams.

    Each upstream has its own pooled HTTP client (connections are reused across turns and
    rollouts; see :mod:`.upstream_http`). A rollout is pinned at register time to the
    least-loaded healthy upstream (fewest pinned rollouts, then fewest requests in flight),
    so its turns hit the same server (prefix cache). An upstream whose requests fail to
    connect is marked unhealthy for new registrations until a request to it succeeds or
    :meth:`probe_unhealthy` finds ``GET {base}/models`` answering again.

    Args:
        urls: OpenAI base URLs (``http://host:port/v1``).
        timeout_s: total deadline of one chat completion (connect, send, wait, read:
            a drip-feeding upstream cannot hold a turn longer than this).
        connect_timeout_s: connect timeout (small: a dead upstream must fail fast).
        transport: an httpx transport for every upstream, or one per URL (tests: every
            call then goes through it).
        api_key: bearer token sent upstream.
        max_connections: connection pool size per upstream.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | Mapping[str, httpx.AsyncBaseTransport] | None = None,
        api_key: str | None = None,
        max_connections: int = 1024,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.upstreams: list[Upstream] = []
        for url in urls:
            http = Http1Upstream(
                url,
                headers=headers,
                connect_timeout_s=connect_timeout_s,
                max_connections=max_connections,
                transport=transport.get(url) if isinstance(transport, Mapping) else transport,
            )
            self.upstreams.append(Upstream(url, http))
        self._by_url = {u.base_url: u for u in self.upstreams}

    def get(self, url: str) -> Upstream:
        """The upstream of ``url``."""
        return self._by_url[url]

    def pin(self) -> Upstream:
        """Choose the upstream of a new rollout and count it as pinned there.

        Among healthy upstreams when there are any; when all are marked unhealthy, among
        all of them (the mark may be stale, and the chat call reports a 502 if not).
        """
        candidates = [u for u in self.upstreams if u.healthy] or self.upstreams
        chosen = min(candidates, key=lambda u: u.load)  # min is stable: first on ties
        chosen.pinned += 1
        return chosen

    def release(self, url: str) -> None:
        """A rollout pinned to ``url`` went away."""
        upstream = self._by_url.get(url)
        if upstream is not None and upstream.pinned > 0:
            upstream.pinned -= 1

    async def chat(self, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """POST ``body`` to ``{url}/chat/completions``; returns (completion, seconds).

        See :meth:`chat_raw` for the errors.
        """
        raw, elapsed = await self.chat_raw(url, body)
        return parse_completion(raw)[0], elapsed

    async def chat_raw(self, url: str, body: dict[str, Any]) -> tuple[bytes, float]:
        """POST ``body`` to ``{url}/chat/completions``; returns (answer bytes, seconds).

        The whole call (connect to last byte) is bounded by ``timeout_s``. Raises
        :class:`UpstreamError`: upstream 4xx -> 400 with the engine's own message (404 and
        429 kept: an unknown model stays not found, clients back off); 5xx, unreachable,
        timeout or a non-JSON answer -> 502 with a short message (the URL and the exception
        go to ``detail``).
        """
        start = time.perf_counter()
        response = await self.post(url, "/chat/completions", jsonio.dumps_request_pieces(body))
        elapsed = time.perf_counter() - start
        raise_for_upstream_status(response, self._by_url[url].label)
        return response.content, elapsed

    async def post(self, url: str, path: str, content: RequestContent) -> HTTPAnswer:
        """One POST to the upstream of ``url`` (``path`` under it, or absolute); its
        answer, whatever the status. Bounded by ``timeout_s`` from connect to last byte;
        counted in flight; a failure to get an answer raises the one classification of
        :meth:`Upstream.connection_failure`."""
        upstream = self._by_url[url]
        with upstream.call:
            async with asyncio.timeout(self.timeout_s):
                response = await upstream.http.post(path, content)
        if not upstream.healthy:
            upstream.answered()
        return response

    async def models(self, url: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """The model cards of ``GET {url}/models`` (vLLM's carry ``max_model_len``)."""
        upstream = self._by_url[url]
        response = await upstream.http.get("/models", timeout_s=timeout_s)
        raise_for_upstream_status(response, upstream.label)
        listing = jsonio.loads_lenient(response.content)
        check_answer_writable(listing)  # cards reach agents as they are
        data = listing.get("data") if isinstance(listing, dict) else None
        return [card for card in data or () if isinstance(card, dict)]

    async def probe_unhealthy(self, timeout_s: float = 2.0) -> None:
        """Re-probe unhealthy upstreams with ``GET {base}/models``; mark answering ones healthy."""
        for upstream in self.upstreams:
            if upstream.healthy:
                continue
            try:
                response = await upstream.http.get("/models", timeout_s=timeout_s)
            except Exception as exc:
                if upstream.http.failure_kind(exc) is None:
                    raise
                continue
            if response.status_code < 500:
                logger.info("upstream=%s healthy again (probe)", upstream.label)
                upstream.healthy = True

    def describe(self) -> list[dict[str, Any]]:
        """State of every upstream (for ``/health``)."""
        return [
            {"url": u.label, "healthy": u.healthy, "pinned": u.pinned, "in_flight": u.in_flight}
            for u in self.upstreams
        ]

    async def aclose(self) -> None:
        """Close every connection pool."""
        for upstream in self.upstreams:
            await upstream.http.aclose()


__all__ = [
    "ErrorKind",
    "Upstream",
    "UpstreamCall",
    "UpstreamError",
    "agent_status",
    "check_answer_writable",
    "clean_text",
    "connection_failure",
    "malformed_answer",
    "UpstreamPool",
    "raise_for_upstream_status",
    "parse_completion",
    "redact_url",
]
