"""What a dialect is: one wire format an agent speaks, translated at the gateway's edge.

Every turn runs as a chat completion: the engine gets a chat request, answers a chat
completion (or its chunks), and the gateway records chat messages. A :class:`Dialect`
is the thin edge around that (modelled on verifiers v1's ``Dialect``: routes, parse,
render), with no web framework and no server state in it:

- its routes, relative to a rollout's URL and at the gateway's root (found by key);
- where its agents carry the rollout's key (:meth:`Dialect.credential`);
- :meth:`Dialect.parse`: the agent's body -> a :class:`ParsedRequest`, the chat request
  the engine gets plus the facts the turn records about what the agent sent;
- :meth:`Dialect.render`: a whole chat completion -> the dialect's answer;
- :meth:`Dialect.stream`: a :class:`StreamRenderer`, fed the engine's chunks one by one,
  each turned into the dialect's events as it arrives;
- :meth:`Dialect.error_answer` / :meth:`StreamRenderer.error`: a
  :class:`~.errors.GatewayError` in the dialect's error shape.

Renderers are deterministic functions of the completion and the request, so a retry
replayed from a recorded answer gets the same answer (ids are derived from the engine's
completion id).
"""

from __future__ import annotations

import functools
import heapq
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from rollout_gateway.server.dialects.completion import completion_chunks
from rollout_gateway.server.dialects.errors import GatewayError
from rollout_gateway.server.http.auth import parse_bearer
from rollout_gateway.server.http.jsonio import ConversationText

#: A turn records at most this many names of the agent's fields it ignored, each cut to
#: this many characters (the agent chooses them; see ``upstream_request``'s same bounds).
MAX_FIELD_NAMES = 32
MAX_FIELD_NAME_CHARS = 64
#: Bodies of up to this many fields, of names this long together, have their unknown
#: names cached (by the fields' names, 256 sets of them: at most 1 MB).
_CACHED_NAMES = 64
_CACHED_NAME_CHARS = 4096


@dataclass(slots=True)
class ParsedRequest:
    """An agent's request as the turn runs it.

    ``body`` is a chat-completions request in the shape the chat path takes from agents
    (``messages``, ``tools``, ``tool_choice``, ``parallel_tool_calls``,
    ``response_format``, ``stop``, ``max_tokens``, ``stream``): the turn builds the
    upstream request from it as for a chat agent (registered model and sampling win).
    ``messages`` is ``body["messages"]`` and ``messages_text`` its JSON, written once
    (the history check and the upstream request both use it). ``facts`` go on the
    turn's step: the ``dialect``, the agent's own sampling fields as it sent them
    (``agent_sampling``), the fields it sent that mean nothing here
    (``ignored_fields``), and what the engine was not given (``dropped_tools``,
    ``dropped_content``). ``context`` is what the dialect's renderers need from the
    request (whether thinking is shown, tool namespaces...).
    """

    dialect: str
    body: dict[str, Any]
    messages: list[dict[str, Any]]
    messages_text: bytes
    stream: bool
    facts: dict[str, Any] = field(default_factory=dict)
    context: Any = None
    #: What the request translated to, for the dialect's parse of the rollout's next
    #: request (:class:`~.memo.ParseMemo`; ``None``: nothing to keep).
    memo: Any = None


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """An error as an HTTP answer: status, JSON body, extra headers."""

    status: int
    body: bytes
    headers: Mapping[str, str]


class StreamRenderer(ABC):
    """The dialect's SSE events of one streamed turn, produced as the engine's chunks come.

    A state machine: :meth:`feed` takes each engine chunk (a parsed
    ``chat.completion.chunk``) and returns the events it makes (``b""``: none yet), so
    each text or tool-argument delta reaches the agent when its chunk reaches the
    gateway; :meth:`finish` takes the whole completion the chunks added up to and returns
    the closing events. :meth:`whole` is the stream of an answer the engine gave whole
    (token-in mode, engines that cannot stream token ids).
    """

    #: What the turn sends while the engine is silent (each dialect's own keepalive).
    keepalive: ClassVar[bytes] = b": keepalive\n\n"

    @abstractmethod
    def feed(self, chunk: dict[str, Any]) -> bytes:
        """The events one engine chunk makes (``b""`` when it makes none)."""

    @abstractmethod
    def finish(self, completion: dict[str, Any]) -> bytes:
        """The closing events, once the engine's stream has ended with ``completion``."""

    @abstractmethod
    def error(self, error: GatewayError) -> bytes:
        """The events that end the stream with ``error`` (the agent's SDK raises it)."""

    def whole(self, completion: dict[str, Any]) -> bytes:
        """The whole stream of ``completion`` (an answer the engine did not stream)."""
        events = [self.feed(chunk) for chunk in completion_chunks(completion)]
        events.append(self.finish(completion))
        return b"".join(events)


class Dialect(ABC):
    """One wire format an agent speaks (see the module doc)."""

    #: Recorded on each turn's step (``extras.dialect``).
    name: ClassVar[str]
    #: Turn routes, relative to a rollout's URL (``/v1/rollouts/{id}``); the query string
    #: is ignored.
    routes: ClassVar[tuple[str, ...]]
    #: Side routes relative to a rollout's URL, answered and never recorded.
    aux_routes: ClassVar[tuple[str, ...]] = ()
    #: Turn routes at the gateway's root, the rollout found by its key.
    keyed_routes: ClassVar[tuple[str, ...]]
    #: Side routes at the gateway's root, the rollout found by its key.
    keyed_aux_routes: ClassVar[tuple[str, ...]] = ()
    #: The provider path verifiers v1 records as ``ModelCall.endpoint`` for this format.
    upstream_path: ClassVar[str]
    #: The agent's sampling fields recorded as it sent them (``facts["agent_sampling"]``):
    #: verifiers v1's ``sampling_fields`` of the same dialect, so v1's own
    #: ``parse_sampling`` reads the record as it reads the request.
    sampling_fields: ClassVar[frozenset[str]]
    #: The dialect's keepalive (see :attr:`StreamRenderer.keepalive`).
    keepalive: ClassVar[bytes] = b": keepalive\n\n"

    def credential(self, authorization: str | None, api_key: str | None) -> str | None:
        """The rollout key the agent presented: ``Authorization: Bearer`` (the OpenAI
        SDK's carrier; an ``x-api-key`` header is ignored)."""
        return parse_bearer(authorization)

    @abstractmethod
    def parse(
        self, body: dict[str, Any], memo: Any = None, conversation: ConversationText | None = None
    ) -> ParsedRequest:
        """The agent's request as the turn runs it (raises :class:`~.errors.RequestError`).

        ``memo``: the :attr:`ParsedRequest.memo` of the rollout's previous request
        (:mod:`.memo`): the messages it had already translated are taken as they are.
        ``conversation``: the body's conversation list as the intake's depth check wrote
        it (:func:`~..http.jsonio.loads_chat_body`), when it did; the memo's check
        compares texts instead of objects (only when its ``field`` is the one this
        dialect reads).
        """

    @abstractmethod
    def render(self, completion: dict[str, Any], request: ParsedRequest) -> Mapping[str, Any]:
        """The dialect's answer to ``request`` from the engine's whole ``completion``."""

    def render_json(self, completion: dict[str, Any], request: ParsedRequest) -> bytes:
        """:meth:`render`'s answer as JSON (``orjson``'s bytes; a dialect may write its
        usual answer at once, the same bytes). Raises ``TypeError`` for what orjson
        cannot write."""
        return orjson.dumps(self.render(completion, request))

    @abstractmethod
    def stream(self, request: ParsedRequest) -> StreamRenderer:
        """A renderer for one streamed answer to ``request``."""

    @abstractmethod
    def error_body(self, error: GatewayError) -> Mapping[str, Any]:
        """``error`` as the dialect's JSON error body."""

    def error_answer(self, error: GatewayError) -> ErrorAnswer:
        """``error`` as an HTTP answer whose status the agent's SDK maps to its typed
        error (``anthropic.NotFoundError``, ``openai.PermissionDeniedError``...)."""
        return ErrorAnswer(error.status, orjson.dumps(self.error_body(error)), error.headers)

    def recorded_answer(self, message: dict[str, Any], request: ParsedRequest) -> dict[str, Any]:
        """The engine's assistant ``message`` as the agent will echo it in its next
        request, once the dialect's answer has gone round (what the turn records, so the
        next request extends the recorded history and v1 reads it as its own dialect
        parser reads the echo). The message itself unless the dialect adds state."""
        return message


def field_names(body: Mapping[str, Any], known: frozenset[str]) -> list[str]:
    """The names of ``body``'s fields not in ``known``: sorted, at most
    :data:`MAX_FIELD_NAMES`, each cut to :data:`MAX_FIELD_NAME_CHARS` characters."""
    if body.keys() <= known:  # the usual case, one pass in C
        return []
    keys = tuple(body)
    if len(keys) <= _CACHED_NAMES and sum(map(len, keys)) <= _CACHED_NAME_CHARS:
        return list(_unknown_names(keys, known))  # an agent sends the same fields every turn
    return list(_unknown_names.__wrapped__(keys, known))


@functools.lru_cache(maxsize=256)
def _unknown_names(keys: tuple[str, ...], known: frozenset[str]) -> tuple[str, ...]:
    names = [k for k in keys if k not in known]
    if len(names) > MAX_FIELD_NAMES:
        names = heapq.nsmallest(MAX_FIELD_NAMES, names)
    else:
        names.sort()
    return tuple(n[:MAX_FIELD_NAME_CHARS] for n in names)


def named_event(name: bytes, payload: Any) -> bytes:
    """One SSE event with an ``event:`` line (both Anthropic's and the Responses API's
    framing; Anthropic's SDK skips events without one)."""
    return b"event: " + name + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


__all__ = [
    "MAX_FIELD_NAMES",
    "MAX_FIELD_NAME_CHARS",
    "Dialect",
    "ErrorAnswer",
    "ParsedRequest",
    "StreamRenderer",
    "field_names",
    "named_event",
]
