"""JSON in and out of the gateway, with orjson.

orjson (a dependency since issue 11) is several times faster than the standard library
on the large chat bodies the gateway handles every turn, and it closes a class of bad
input by construction: it rejects lone surrogates, ``NaN``/``Infinity`` literals, numbers
that overflow a double (``1e400``) and nesting deeper than 1024 levels with a
``JSONDecodeError`` (the standard library accepts the first three and raises
``RecursionError`` on the last), and it writes non-finite floats as ``null``. It writes
at most 254 levels, so request bodies are bounded tighter (:data:`MAX_BODY_DEPTH`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response

#: Bodies larger than this are parsed in a worker thread so that one big request does
#: not stall every other rollout's turn on the event loop (orjson releases nothing, but a
#: thread lets the loop keep serving while the GIL switches every few milliseconds).
OFF_LOOP_PARSE_BYTES = 256 * 1024

JSONDecodeError = orjson.JSONDecodeError

#: Deepest nesting of containers a request body may have (the body itself is level 1).
#: orjson reads 1024 levels but writes at most 254, and the gateway writes what it keeps
#: a few levels deeper than the agent sent it (a message sits 2 levels deeper in a
#: trajectory, a turn's ``stop`` 4): a body it can read but not write back was a 500 on
#: the turn, or a trajectory that could not be fetched.
MAX_BODY_DEPTH = 128
_ORJSON_MAX_DEPTH = 254


class TooDeepError(ValueError):
    """A request body nests deeper than :data:`MAX_BODY_DEPTH`."""


def loads(raw: bytes | str) -> Any:
    """Parse strict JSON (raises :class:`JSONDecodeError`, a ``ValueError``)."""
    return orjson.loads(raw)


def loads_body(raw: bytes | str) -> Any:
    """Parse a request body: strict JSON (:func:`loads`) that the gateway can write back
    wherever it keeps it (raises :class:`TooDeepError` past :data:`MAX_BODY_DEPTH`)."""
    value = orjson.loads(raw)
    check_depth(value)
    return value


def check_depth(value: Any, max_depth: int = MAX_BODY_DEPTH) -> None:
    """Raise :class:`TooDeepError` when ``value`` nests deeper than ``max_depth``.

    Written by orjson inside ``254 - max_depth`` lists, ``value`` fails exactly then: one
    pass in C (a 170 kB chat body takes ~10 us), not a walk of every node in Python.
    """
    chain = None
    if max_depth == MAX_BODY_DEPTH:
        with contextlib.suppress(IndexError):  # none free: a new one
            chain = _wrapper_chains.pop()
    if chain is None:
        chain = _wrapper_chain(_ORJSON_MAX_DEPTH - max_depth)
    outer, inner = chain
    inner[0] = value
    try:
        orjson.dumps(outer)
    except orjson.JSONEncodeError:
        raise TooDeepError(f"request body nests deeper than {max_depth} levels") from None
    finally:
        inner[0] = None
        if max_depth == MAX_BODY_DEPTH:
            _wrapper_chains.append(chain)


def _wrapper_chain(levels: int) -> tuple[list[Any], list[Any]]:
    """``levels`` nested one-element lists: the outermost and the innermost."""
    inner: list[Any] = [None]
    outer = inner
    for _ in range(levels - 1):
        outer = [outer]
    return outer, inner


#: Wrapper chains of :func:`check_depth` for the default depth, reused: building one is
#: half its cost on a chat body. Each is taken by one call at a time (``list.pop`` and
#: ``append`` are atomic), so bodies parsed in worker threads get their own.
_wrapper_chains: list[tuple[list[Any], list[Any]]] = []


async def loads_off_loop(raw: bytes) -> Any:
    """Like :func:`loads_body`; bodies over :data:`OFF_LOOP_PARSE_BYTES` parse in a thread."""
    if len(raw) > OFF_LOOP_PARSE_BYTES:
        return await asyncio.to_thread(loads_body, raw)
    return loads_body(raw)


class BodyParser:
    """Parses request bodies; at most ``max_concurrent`` big ones at once, gateway-wide.

    A parsed body costs several times its size in Python objects while it is handled;
    without a global bound, hundreds of agents sending big bodies at once multiply that
    by their number. Big bodies beyond the bound wait their turn (their raw bytes are
    already held); small ones parse at once on the loop.

    Args:
        max_concurrent: big bodies parsed at the same time.
        off_loop_bytes: bodies larger than this are big (parsed in a worker thread).
        loads: the parse function (a seam for tests).
    """

    def __init__(
        self,
        max_concurrent: int,
        *,
        off_loop_bytes: int = OFF_LOOP_PARSE_BYTES,
        loads: Callable[[bytes], Any] = loads_body,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent: must be at least 1, got {max_concurrent!r}")
        self.max_concurrent = max_concurrent
        self.off_loop_bytes = off_loop_bytes
        self._loads = loads
        self._slots: asyncio.Semaphore | None = None  # made on first use, in the loop

    async def loads(self, raw: bytes) -> Any:
        """Parse ``raw`` as strict JSON (raises :class:`JSONDecodeError`, or
        :class:`TooDeepError` past :data:`MAX_BODY_DEPTH`)."""
        if len(raw) <= self.off_loop_bytes:
            return self._loads(raw)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        async with self._slots:
            return await asyncio.to_thread(self._loads, raw)


def loads_lenient(raw: bytes) -> Any:
    """Parse an upstream's answer: strict first, then the standard library.

    Engines written in Python serialise a ``-inf`` logprob as ``-Infinity`` (not JSON);
    the answer is still the engine's and must be recorded, not refused.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Serialise to compact JSON bytes (non-finite floats become ``null``)."""
    return orjson.dumps(value)


class JSONBytesResponse(Response):
    """A JSON response serialised with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """Serialise ``content``."""
        return orjson.dumps(content)


__all__ = [
    "MAX_BODY_DEPTH",
    "BodyParser",
    "OFF_LOOP_PARSE_BYTES",
    "JSONBytesResponse",
    "JSONDecodeError",
    "TooDeepError",
    "check_depth",
    "dumps",
    "loads",
    "loads_body",
    "loads_lenient",
    "loads_off_loop",
]
