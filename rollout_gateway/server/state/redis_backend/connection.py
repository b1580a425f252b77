"""One gateway's connections to Redis: :class:`RedisConnection`.

redis-py's asyncio client (hiredis parses the replies), one connection pool (opened on the
event loop that serves, in the app's startup), the scripts of :mod:`.scripts` run by their
SHA-1 (``EVALSHA``, loaded again when Redis lost them), and Redis's "cannot serve now"
errors turned into :class:`~rollout_gateway.server.state.store.StoreUnavailableError` (the
request gets a 503 its client retries; the pool reconnects on the next call). A pooled
connection that a restarted Redis closed while it was idle is reconnected before its next
command, not failed.

A script runs as one ``EVALSHA`` command: redis-py's ``Script`` object does the same with
more Python around it per call (a quarter of the client's CPU per call, measured; two
calls a turn). The commands that concurrent turns issue in one loop iteration go to Redis
in one pipeline (:mod:`.batches`).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.maint_notifications import MaintNotificationsConfig

from rollout_gateway.server.state.redis_backend import scripts
from rollout_gateway.server.state.redis_backend.batches import CommandBatches
from rollout_gateway.server.state.store import StoreUnavailableError

#: Redis cannot serve now (not reachable, loading its data, out of memory, read-only, or
#: its disk full: ``MISCONF``).
_UNAVAILABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    OSError,
)
_UNAVAILABLE_REPLIES = ("MISCONF", "OOM", "LOADING", "READONLY", "MASTERDOWN")


def unavailable(exc: Exception) -> bool:
    """Whether ``exc`` says Redis cannot serve now (rather than a mistake of ours)."""
    if isinstance(exc, _UNAVAILABLE):
        return True
    return isinstance(exc, redis_errors.ResponseError) and str(exc).startswith(_UNAVAILABLE_REPLIES)


class RedisConnection:
    """The connection pool, and the calls made on it.

    Args:
        url: the Redis URL (``redis://``, ``rediss://``, ``unix://``).
        timeout_s: connect and reply timeout of one call.
    """

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._client: aioredis.Redis | None = None
        #: Each script's SHA-1, by name (what ``EVALSHA`` names it by).
        self._shas = {
            name: hashlib.sha1(getattr(scripts, name).encode()).hexdigest()
            for name in scripts.__all__
        }
        self._batches = CommandBatches(lambda: self.client)

    @property
    def client(self) -> aioredis.Redis:
        """The pool (made on first use)."""
        if self._client is None:
            self._client = self.new_client()
        return self._client

    def new_client(self, **options: Any) -> aioredis.Redis:
        """Another client on the same Redis (``options`` override the timeouts)."""
        settings: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            # redis-py 8's default ("auto") skips the pool's check, before handing out an
            # idle connection, that its server has not closed it: after a Redis restart
            # each idle connection's next command failed (one 503 each). Off, the pool
            # reconnects it first. (These notifications are Redis Enterprise's.)
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        return aioredis.Redis.from_url(self.url, **{**settings, **options})

    @property
    def where(self) -> str:
        """Where the Redis is, for messages (no password)."""
        kw = self.client.connection_pool.connection_kwargs
        if "path" in kw:
            return str(kw["path"])
        return f"{kw.get('host', '?')}:{kw.get('port', '')}/{kw.get('db', 0)}"

    async def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run the script ``name`` of :mod:`.scripts` (loaded again after Redis lost it)."""
        client = self.client
        try:
            sha = self._shas[name]
            try:
                return await self._batches.call("EVALSHA", sha, len(keys), *keys, *args)
            except redis_errors.NoScriptError:  # a restarted Redis, or its SCRIPT FLUSH
                await client.execute_command("SCRIPT LOAD", getattr(scripts, name))
                return await self._batches.call("EVALSHA", sha, len(keys), *keys, *args)
        except Exception as exc:
            if unavailable(exc):
                raise StoreUnavailableError(f"redis at {self.where}: {exc}") from exc
            raise

    async def cmd(self, *command: Any) -> Any:
        """One command."""
        try:
            return await self._batches.call(*command)
        except Exception as exc:
            if unavailable(exc):
                raise StoreUnavailableError(f"redis at {self.where}: {exc}") from exc
            raise

    async def aclose(self) -> None:
        """Close the pool."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()


__all__ = ["RedisConnection", "unavailable"]
