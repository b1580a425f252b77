"""The gateways' shared state in Redis: keys, the atomic scripts, and what they answer.

:class:`RedisState` is the one place that speaks to Redis (redis-py's asyncio client,
replies parsed by hiredis when installed). Every method is one round trip: a Lua script
(:mod:`.scripts`) or one command. A connection failure or timeout becomes
:class:`StoreUnavailable`, which the gateway answers with 503 (the agent's SDK retries).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from rollout_gateway.server.state.redis_backend import scripts

#: The layout of the data this code writes; another layout is refused, never misread.
SCHEMA = 1

#: Channel on which a turn's end, a cancel or a removal is announced (payload: rollout id).
TURNS_CHANNEL = "turns"
#: Exit reports kept in the stream (approximately; older ones are trimmed).
EXITS_MAXLEN = 100_000


class StoreUnavailable(Exception):
    """Redis cannot be reached (or timed out): the request may be retried."""


class StateVersionError(Exception):
    """Redis holds state written in another layout (:data:`SCHEMA`)."""


@dataclass(frozen=True, slots=True)
class RolloutKeys:
    """The keys of one rollout (see docs/state.md)."""

    rollout: str
    events: str
    lease: str

    def all(self) -> list[str]:
        """In the order the scripts take them: rollout, lease, events."""
        return [self.rollout, self.lease, self.events]


@dataclass(slots=True)
class Claim:
    """What :meth:`RedisState.claim` found.

    ``outcome``: ``"claimed"`` (the turn is ours to run), ``"running"`` (this very turn
    runs on a gateway), ``"busy"`` (another turn of the rollout runs), ``"answered"``
    (a retry of the last answered turn: ``answer``), ``"gone"`` (not registered).
    """

    outcome: Literal["claimed", "running", "busy", "answered", "gone"]
    ver: int = 0
    counters: bytes = b""
    cancelled: bool = False
    answer: bytes = b""
    #: The rollout's events (recorded steps, abandonments) the caller did not hold.
    events: list[bytes] = field(default_factory=list)


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class RedisState:
    """The shared state of the gateways behind one Redis.

    Args:
        client: redis-py's asyncio client (``decode_responses`` off).
        prefix: prepended to every key (several deployments may share one Redis).
        lease_ms: how long a claimed turn stays claimed without renewal.
        ttl_ms: a rollout idle this long is dropped (Redis expires its keys).
    """

    def __init__(
        self, client: aioredis.Redis, *, prefix: str = "rg:", lease_ms: int, ttl_ms: int
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.lease_ms = lease_ms
        self.ttl_ms = ttl_ms
        self.channel = f"{prefix}{TURNS_CHANNEL}"
        self.exits_key = f"{prefix}exits"
        self._scripts = {
            name: client.register_script(getattr(scripts, name)) for name in scripts.__all__
        }
        #: The digest seed shared by every gateway (set by :meth:`open`).
        self.secret = b""

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 5.0, **kwargs: Any) -> RedisState:
        """A state on the Redis at ``url`` (``redis://``, ``rediss://`` or ``unix://``)."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
            # Our own retry: a failed call is a 503 the agent retries (no hidden waits).
            retry_on_timeout=False,
        )
        return cls(client, **kwargs)

    def keys(self, rollout_id: str) -> RolloutKeys:
        p = self.prefix
        return RolloutKeys(f"{p}r:{rollout_id}", f"{p}s:{rollout_id}", f"{p}lease:{rollout_id}")

    def key_index(self, key_digest: str) -> str:
        return f"{self.prefix}k:{key_digest}"

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await self._scripts[name](keys=list(keys), args=list(args))
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc

    async def call(self, *command: Any) -> Any:
        """One plain command (:class:`StoreUnavailable` when Redis is not there)."""
        try:
            return await self.client.execute_command(*command)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc

    # -- start-up --------------------------------------------------------------------------

    async def open(self) -> None:
        """Check Redis answers and holds our layout (or nothing yet); load the shared secret.

        Raises :class:`StoreUnavailable` or :class:`StateVersionError`.
        """
        meta = f"{self.prefix}meta"
        await self.call("HSETNX", meta, "schema", SCHEMA)
        await self.call("HSETNX", meta, "secret", secrets.token_hex(32))
        schema, secret = await self.call("HMGET", meta, "schema", "secret")
        if int(schema) != SCHEMA:
            raise StateVersionError(
                f"Redis holds gateway state of layout {int(schema)} under {self.prefix!r}; this "
                f"gateway reads layout {SCHEMA} only (use another prefix or database, or "
                "the gateway version that wrote it)"
            )
        self.secret = bytes.fromhex(secret.decode())

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- rollouts --------------------------------------------------------------------------

    async def create(
        self, rollout_id: str, registration: bytes, counters: bytes, key_digest: str | None
    ) -> bool:
        """Store a new rollout; false when one with this id exists."""
        k = self.keys(rollout_id)
        index = self.key_index(key_digest) if key_digest else k.rollout
        args = [registration, counters, self.ttl_ms, SCHEMA, rollout_id]
        return bool(await self._run("CREATE", [k.rollout, index], args))

    async def load(self, rollout_id: str) -> tuple[dict[bytes, bytes], list[bytes]] | None:
        """The rollout's hash and its events (``None`` when it is not registered)."""
        k = self.keys(rollout_id)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.execute_command("HGETALL", k.rollout)
                pipe.execute_command("LRANGE", k.events, 0, -1)
                fields, events = await pipe.execute()
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        if not fields:
            return None
        if int(fields.get(b"v", b"0")) != SCHEMA:
            raise StateVersionError(
                f"rollout {rollout_id} was stored in layout {fields.get(b'v')!r}, not {SCHEMA}"
            )
        return fields, events

    async def rollout_for_key(self, key_digest: str) -> str | None:
        value = await self.call("GET", self.key_index(key_digest))
        return value.decode() if value is not None else None

    async def cancel(self, rollout_id: str) -> bool:
        """Mark the rollout cancelled (later turns are refused); false when unknown."""
        keys = [self.keys(rollout_id).rollout]
        return bool(await self._run("CANCEL", keys, [self.channel, rollout_id]))

    async def delete(self, rollout_id: str, key_digest: str | None) -> bytes | None:
        """Remove the rollout; its counters as they were (``None`` when unknown)."""
        k = self.keys(rollout_id)
        index = self.key_index(key_digest) if key_digest else k.rollout
        keys = [k.rollout, k.events, k.lease, index]
        result = await self._run("DELETE", keys, [self.channel, rollout_id])
        return result if result else None

    async def touch(self, rollout_id: str) -> None:
        """Postpone the rollout's idle expiry."""
        k = self.keys(rollout_id)
        await self._run("TOUCH", [k.rollout, k.events], [self.ttl_ms])

    # -- turns -----------------------------------------------------------------------------

    async def claim(
        self,
        rollout_id: str,
        owner: str,
        fingerprint: bytes,
        idempotency_key: str | None,
        *,
        held: int,
        window_ms: int,
        is_retry: bool,
    ) -> Claim:
        """Take the rollout's turn lease, or say why not (see :class:`Claim`)."""
        k = self.keys(rollout_id)
        args = [
            owner, fingerprint, idempotency_key or "", self.lease_ms, held, window_ms,
            "1" if is_retry else "0", self.ttl_ms,
        ]  # fmt: skip
        reply = await self._run("CLAIM", k.all(), args)
        outcome = reply[0].decode()
        if outcome == "answered":
            return Claim("answered", answer=reply[1])
        if outcome != "claimed":
            return Claim(outcome)
        return Claim(
            "claimed",
            ver=int(reply[1]),
            counters=reply[2],
            cancelled=reply[3] == b"1",
            events=list(reply[4:]),
        )

    async def renew(self, rollout_id: str, owner: str) -> bool:
        """Extend our lease; false when it is no longer ours."""
        lease = self.keys(rollout_id).lease
        return bool(await self._run("RENEW", [lease], [owner, self.lease_ms]))

    async def release(self, rollout_id: str, owner: str) -> None:
        lease = self.keys(rollout_id).lease
        await self._run("RELEASE", [lease], [owner, self.channel, rollout_id])

    async def commit(
        self,
        rollout_id: str,
        owner: str,
        ver: int,
        counters: bytes,
        events: Sequence[bytes],
        *,
        answer: bytes = b"",
        fingerprint: bytes = b"",
        idempotency_key: str | None = None,
        delivered: bool = False,
    ) -> tuple[str, int]:
        """Append ``events``, write ``counters`` and the answer, drop the lease: atomically,
        if the lease is ours and nobody committed since ``ver``. Answers ``("ok", new
        ver)``, ``("lost", 0)``, ``("gone", 0)`` or ``("stale", ver)``."""
        k = self.keys(rollout_id)
        args = [
            owner, ver, counters, answer, fingerprint, idempotency_key or "",
            "1" if delivered else "0", self.ttl_ms, self.channel, rollout_id, *events,
        ]  # fmt: skip
        reply = await self._run("COMMIT", k.all(), args)
        outcome = reply[0].decode()
        return outcome, int(reply[1]) if len(reply) > 1 else 0

    async def delivered(
        self, rollout_id: str, fingerprint: bytes, idempotency_key: str | None
    ) -> None:
        """The last answer reached a client (a later identical body is a new turn)."""
        await self._run(
            "DELIVERED", [self.keys(rollout_id).rollout], [fingerprint, idempotency_key or ""]
        )

    # -- exits and policy ------------------------------------------------------------------

    async def report_exit(self, rollout_id: str, exit_code: int | None, kind: str = "exit") -> int:
        """Append an exit report (or a forget mark) to the shared stream; its number."""
        keys = [self.exits_key, f"{self.exits_key}:seq"]
        code = "" if exit_code is None else str(exit_code)
        return int(await self._run("EXIT", keys, [rollout_id, code, kind, EXITS_MAXLEN]))

    async def read_exits(
        self, after_id: bytes, block_ms: int | None
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Stream entries after ``after_id`` (waiting up to ``block_ms`` for one)."""
        command: list[Any] = ["XREAD", "COUNT", 1000]
        if block_ms is not None:
            command += ["BLOCK", block_ms]
        reply = await self.call(*command, "STREAMS", self.exits_key, after_id)
        return [(entry_id, fields) for entry_id, fields in reply[0][1]] if reply else []

    async def announce_policy(self, version: int) -> tuple[bool, int, float | None, int]:
        """Forward-only compare-and-set of the policy version: (accepted, version,
        updated_at (Unix s), epoch); not accepted when ``version`` is older."""
        reply = await self._run("ANNOUNCE", [f"{self.prefix}policy"], [version, self.channel])
        if reply[0] == b"stale":
            return False, int(reply[1]), None, 0
        return True, int(reply[1]), int(reply[2]) / 1000, int(reply[3])

    async def policy(self) -> tuple[int | None, float | None, int]:
        """(version, updated_at, epoch) as stored (``None``, ``None``, 0 before any)."""
        version, at, epoch = await self.call(
            "HMGET", f"{self.prefix}policy", "version", "updated_at", "epoch"
        )
        if version is None:
            return None, None, 0
        return int(version), int(at) / 1000, int(epoch)


__all__ = [
    "SCHEMA",
    "Claim",
    "RedisState",
    "RolloutKeys",
    "StateVersionError",
    "StoreUnavailable",
]
