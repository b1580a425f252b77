"""An agent's chat request as the chat turn sees it, read straight from ASGI.

The turn (:mod:`.chat`) needs five headers, the body and a way to notice that the
agent hung up. :class:`AgentRequest` reads those from the ASGI scope in one pass over the
headers, with no Starlette ``Request`` or ``Headers`` object per turn (see
:mod:`~rollout_gateway.server.http.dispatch` for why the agents' routes avoid per-request
framework work).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import Receive, Scope

from rollout_gateway.protocol import IDEMPOTENCY_KEY_HEADER, SDK_RETRY_COUNT_HEADER
from rollout_gateway.server.http.auth import parse_bearer
from rollout_gateway.server.http.connections import READ_TIMER_KEY, ReadTimer
from rollout_gateway.server.http.intake import BodyLease
from rollout_gateway.server.http.responses import until_disconnect

if TYPE_CHECKING:
    from rollout_gateway.server.dialects.base import Dialect

_AUTHORIZATION = b"authorization"
_API_KEY = b"x-api-key"
_CONTENT_LENGTH = b"content-length"
_IDEMPOTENCY_KEY = IDEMPOTENCY_KEY_HEADER.lower().encode()
_RETRY_COUNT = SDK_RETRY_COUNT_HEADER.lower().encode()
_WANTED = frozenset((_AUTHORIZATION, _API_KEY, _CONTENT_LENGTH, _IDEMPOTENCY_KEY, _RETRY_COUNT))


class AgentRequest:
    """The parts of one agent's HTTP request that a chat turn reads.

    Header values are those of the first header of each name (as Starlette's ``Headers``
    would give); ASGI servers hand header names over lower-cased.
    """

    __slots__ = (
        "receive",
        "authorization",
        "api_key",
        "content_length",
        "idempotency_key",
        "retry_count",
        "lease",
        "read_timer",
    )

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.receive = receive
        found: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name in _WANTED and name not in found:
                found[name] = value.decode("latin-1")
        get = found.get
        #: The ``Authorization`` header's value.
        self.authorization: str | None = get(_AUTHORIZATION)
        #: The ``x-api-key`` header's value (the Anthropic SDK's and Claude Code's carrier).
        self.api_key: str | None = get(_API_KEY)
        #: The declared body size, unparsed.
        self.content_length: str | None = get(_CONTENT_LENGTH)
        #: The ``Idempotency-Key`` header's value (``None`` when blank: an empty key would
        #: name every request the same, and each would get the first one's answer).
        self.idempotency_key: str | None = (get(_IDEMPOTENCY_KEY) or "").strip() or None
        #: The OpenAI SDK's ``x-stainless-retry-count`` header's value.
        self.retry_count: str | None = get(_RETRY_COUNT)
        #: What the request holds of the gateway's body budgets (released once answered).
        self.lease: BodyLease | None = None
        #: What reading the request costs the server (set by the gateway's HTTP protocol).
        self.read_timer: ReadTimer | None = (scope.get("extensions") or {}).get(READ_TIMER_KEY)

    @property
    def bearer(self) -> str | None:
        """The bearer token presented, if any."""
        return parse_bearer(self.authorization)

    def credential(self, dialect: Dialect) -> str | None:
        """The rollout key as ``dialect``'s clients carry it (``x-api-key`` or a bearer)."""
        return dialect.credential(self.authorization, self.api_key)

    @property
    def is_retry(self) -> bool:
        """Whether the OpenAI SDK says this is a retry of an earlier request."""
        # No int(): str.isdigit() accepts "²" (a latin-1 header byte) that int() refuses,
        # and int() refuses more than 4300 digits; any ASCII digit string above zero is
        # a retry count.
        count = (self.retry_count or "").strip()
        return count.isascii() and count.isdigit() and count.strip("0") != ""

    async def disconnected(self) -> None:
        """Return when the agent closes its connection (call once the body is read)."""
        await until_disconnect(self.receive)

    def release(self) -> None:
        """Give back what the request holds of the body budgets (it is answered)."""
        if self.lease is not None:
            self.lease.release()


__all__ = ["AgentRequest"]
