"""The scripts' commands sent on redis-py's connections directly: :class:`ScriptLines`.

A turn runs two scripts (the claim, the commit). Sent through redis-py's client, each
command also took a connection from the pool and gave it back (a lock, two observability
records each way, the release event), ran under the client's retry wrapper, wrote under
``asyncio.wait_for`` (a task of its own) and read under a timeout of its own: some 500
Python calls per command, measured, most of a Redis gateway's excess over a memory
gateway's turn. Here the scripts' batches go on connections of redis-py's own
(``Connection``: its handshake, its packing, hiredis parsing the replies, its error
classes) held by this module, one batch at a time each: packed (:func:`packed`), written,
and their replies read under one timeout for the whole batch.

What redis-py's client guaranteed still holds. A connection a restarted Redis closed while
it sat idle (or one left with unread bytes) is reconnected before it is used, as the
pool's check does. A connection or timeout error is retried as the client retries it
(the connection's own :class:`redis.asyncio.retry.Retry`, reconnecting first), a batch
that fails anyway fails each of its commands; an error reply (``NOSCRIPT``, ``OOM``) is
that command's alone. Only scripts go this way: their replies need none of the client's
per-command reply callbacks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.connection import AbstractConnection


class ScriptLines:
    """Connections of their own for the scripts' batches (as many as batches in flight).

    Args:
        pool: the client's connection pool (where to connect, and how).
        timeout_s: a batch's whole exchange (connecting, writing, every reply) must end
            within this, else it is a timeout (as each of the client's reads was).
    """

    def __init__(self, pool: Callable[[], aioredis.ConnectionPool], *, timeout_s: float) -> None:
        self._pool = pool
        self.timeout_s = timeout_s
        self._idle: list[AbstractConnection] = []
        self._all: set[AbstractConnection] = set()

    async def send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply, or its error reply (a :class:`~redis.exceptions.
        ResponseError`, in its place); raises when the connection fails (retried first)."""
        conn = self._idle.pop() if self._idle else self._new()
        try:
            return await conn.retry.call_with_retry(
                lambda: self._exchange(conn, commands), lambda _error: conn.disconnect()
            )
        finally:
            if conn in self._all:
                self._idle.append(conn)

    async def aclose(self) -> None:
        """Close every connection (a batch in flight then fails)."""
        connections, self._all = self._all, set()
        self._idle.clear()
        for conn in connections:
            await conn.disconnect(nowait=True)

    def _new(self) -> AbstractConnection:
        pool = self._pool()
        # No reply timeout of the connection's own: _exchange bounds the whole batch.
        conn = pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": None})
        self._all.add(conn)
        return conn

    async def _exchange(
        self, conn: AbstractConnection, commands: list[tuple[Any, ...]]
    ) -> list[Any]:
        try:
            async with asyncio.timeout(self.timeout_s):
                if conn.is_connected and await conn.can_read():
                    # Bytes nobody asked for, or the end of a connection the server closed
                    # while it sat idle (a restarted Redis): a fresh one, as the pool does.
                    await conn.disconnect()
                if not conn.is_connected:
                    await conn.connect()
                await conn.send_packed_command(packed(commands), check_health=False)
                return [await _reply(conn) for _ in commands]
        except TimeoutError:
            await conn.disconnect(nowait=True)
            raise redis_errors.TimeoutError(f"no reply within {self.timeout_s} s") from None
        except BaseException:
            # Replies may be left unread (cancelled, or failed midway): never reused so.
            await conn.disconnect(nowait=True)
            raise


def packed(commands: list[tuple[Any, ...]]) -> bytes:
    """``commands`` in Redis's protocol (arrays of bulk strings), as redis-py's
    ``pack_commands`` writes them: its encoder is a Python call per argument and its
    buffer is joined again after each one (a script's dozen arguments, twice a turn); here
    one join. Arguments: ``bytes``, ``str`` (UTF-8), ``int`` or ``float``, as redis-py
    takes them."""
    parts: list[bytes] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            kind = type(arg)
            if kind is str:
                arg = arg.encode()
            elif kind is int:
                arg = b"%d" % arg
            elif kind is not bytes:
                arg = _encoded(arg)
            parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(parts)


def _encoded(arg: Any) -> bytes:
    if isinstance(arg, bool):  # (an int, which redis-py refuses too)
        raise redis_errors.DataError(f"cannot send a bool ({arg!r}) to Redis")
    if isinstance(arg, (bytearray, memoryview)):
        return bytes(arg)
    if isinstance(arg, (int, float)):
        return repr(arg).encode()
    if isinstance(arg, str):
        return arg.encode()
    raise redis_errors.DataError(f"cannot send a {type(arg).__name__} to Redis")


async def _reply(conn: AbstractConnection) -> Any:
    try:
        return await conn.read_response()
    except redis_errors.ResponseError as exc:  # read whole: the connection reads on
        return exc


__all__ = ["ScriptLines", "packed"]
