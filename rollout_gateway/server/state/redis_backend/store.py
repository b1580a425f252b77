"""Several gateways on one Redis: :class:`RedisStore`, the shared :class:`GatewayStore`.

Every gateway behind a load balancer may get any request of any rollout. Redis holds
what the gateways must not lose (redis-py's asyncio client; hiredis parses the replies
when installed); each step the gateways share is one Lua script (:mod:`.scripts`), so a
claim never races a claim, nor a commit a removal. Keys (``prefix`` first, ``rg:`` by
default): ``meta`` (layout, shared secret), ``r:{id}`` (the rollout), ``s:{id}`` (its
steps, :mod:`.codec`), ``lease:{id}`` (the gateway running its turn), ``k:{digest}``
(rollout of a key), ``exits`` / ``exits:stream`` / ``exits:seq`` (exit reports, numbered
once for every gateway), ``policy``, and the pub/sub channel ``events``.

A rollout idle for the TTL expires in Redis itself (its keys' ``PEXPIRE``, renewed by
every write and claim). A turn's lease lasts ``lease_s`` and is renewed while its turn
runs: a gateway killed mid-turn leaves it to expire, and the rollout's next request, on
any gateway, then claims it. A lost connection is :class:`StoreUnavailableError` (the
request gets a 503 its client retries); the client reconnects on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import StepDelta
from rollout_gateway.server.state import store as seam
from rollout_gateway.server.state.redis_backend import codec, scripts
from rollout_gateway.server.state.store import (
    AnswerKey,
    GatewayStore,
    PolicyState,
    RolloutCounters,
    RolloutExistsError,
    RolloutRow,
    StoreContents,
    StoredAnswer,
    StoreUnavailableError,
    StoreVersionError,
    TurnCommit,
    TurnConflictError,
    UnknownRolloutError,
)

logger = logging.getLogger("rollout_gateway.server")

#: The layout of what this code writes; another is refused, never misread.
LAYOUT = 1
#: A claim waiting for another gateway's turn looks again at least this often (a pub/sub
#: message wakes it sooner: this bounds what a lost message costs).
RECHECK_S = 0.25
#: Exit reports kept in the stream other gateways follow (approximately).
EXITS_STREAM_LEN = 100_000
_REDIS_DOWN = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)


class RedisStore(GatewayStore):
    """The state of every gateway on one Redis (``serve --redis URL``).

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://``.
        prefix: put before every key (several deployments may share one Redis).
        ttl_s: a rollout idle this long expires (the gateway's ``--rollout-ttl``).
        lease_s: a claimed turn stays claimed this long without renewal (a dead gateway's
            turn is taken over after it).
        timeout_s: connect and reply timeout of one call.
    """

    name = "redis"
    shared = True
    durable = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "rg:",
        ttl_s: float = 3600.0,
        lease_s: float = 10.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.ttl_ms = int(ttl_s * 1000)
        self.lease_s = lease_s
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._scripts = {
            name: self.client.register_script(getattr(scripts, name)) for name in scripts.__all__
        }
        self.channel = f"{prefix}events"
        self._secret = b""
        self._wakers: dict[str, asyncio.Event] = {}
        self._listener: asyncio.Task[None] | None = None
        self._renewers: dict[str, asyncio.TimerHandle] = {}
        #: The owner holding each rollout's lease from this process (commit checks it).
        self._owners: dict[str, str] = {}
        #: Called with the new policy state when another gateway announces one.
        self.on_policy: Callable[[PolicyState], None] | None = None

    # -- plumbing ------------------------------------------------------------------------

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._scripts[name](keys=keys, args=args)
        except _REDIS_DOWN as exc:
            raise StoreUnavailableError(f"redis at {self._where()}: {exc}") from exc

    async def _cmd(self, *command: Any) -> Any:
        try:
            return await self.client.execute_command(*command)
        except _REDIS_DOWN as exc:
            raise StoreUnavailableError(f"redis at {self._where()}: {exc}") from exc

    def _where(self) -> str:
        kw = self.client.connection_pool.connection_kwargs
        return f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"

    def _keys(self, rollout_id: str) -> list[str]:
        """The rollout's hash, steps list and lease, in the order the scripts take them."""
        p = self.prefix
        return [f"{p}r:{rollout_id}", f"{p}s:{rollout_id}", f"{p}lease:{rollout_id}"]

    # -- life ----------------------------------------------------------------------------

    @property
    def secret(self) -> bytes:
        return self._secret

    async def open(self) -> StoreContents:
        meta = f"{self.prefix}meta"
        await self._cmd("HSETNX", meta, "layout", LAYOUT)
        await self._cmd("HSETNX", meta, "secret", secrets.token_hex(32))
        layout, secret = await self._cmd("HMGET", meta, "layout", "secret")
        if int(layout) != LAYOUT:
            raise StoreVersionError(
                f"Redis holds gateway state of layout {int(layout)} under prefix "
                f"{self.prefix!r}; this gateway reads layout {LAYOUT} only (use another "
                "--redis-prefix or database, or the gateway version that wrote it)"
            )
        self._secret = bytes.fromhex(secret.decode())
        exits, cursor = await self._load_exits()
        contents = StoreContents(policy=await self.load_policy(), exits=exits, exit_cursor=cursor)
        self._listener = asyncio.create_task(self._listen())
        return contents

    async def close(self) -> None:
        for handle in self._renewers.values():
            handle.cancel()
        self._renewers.clear()
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        with contextlib.suppress(Exception):
            await self.client.aclose()

    async def _listen(self) -> None:
        """Wake the claims waiting on a rollout when its lease is released, and pass on
        policy announcements; reconnects after Redis comes back."""
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                async for message in pubsub.listen():
                    data = message.get("data")
                    if not data:
                        if self.on_policy is not None:
                            self.on_policy(await self.load_policy())
                        continue
                    event = self._wakers.pop(data.decode(), None)
                    if event is not None:
                        event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("redis pub/sub lost (%s); reconnecting", exc)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(RECHECK_S)

    # -- rollouts ------------------------------------------------------------------------

    async def create_rollout(self, row: RolloutRow) -> None:
        reg = row.registration
        digest = reg.get("key_digest")
        keys = self._keys(reg["rollout_id"])
        keys.append(f"{self.prefix}k:{digest}" if digest else keys[0])
        args = [orjson.dumps(reg), orjson.dumps(row.counters), self.ttl_ms, LAYOUT,
                reg["rollout_id"]]  # fmt: skip
        if (await self._run("CREATE", keys, args))[0] == b"exists":
            raise RolloutExistsError(reg["rollout_id"])

    async def load_rollout(self, rollout_id: str) -> RolloutRow | None:
        fields = await self._cmd("HGETALL", self._keys(rollout_id)[0])
        if not fields:
            return None
        if int(fields.get(b"v", b"0")) != LAYOUT:
            raise StoreVersionError(
                f"rollout {rollout_id} is stored in layout {fields.get(b'v')!r}, not {LAYOUT}"
            )
        answer_key = None
        if fields.get(b"a_key"):
            fp, idem, at, step = orjson.loads(fields[b"a_key"])
            answer_key = AnswerKey(bytes.fromhex(fp), idem, at, step)
        return RolloutRow(
            orjson.loads(fields[b"reg"]),
            orjson.loads(fields[b"counters"]),
            revision=int(fields[b"rev"]),
            steps=int(fields[b"steps"]),
            answer_key=answer_key,
            cancelled=fields.get(b"cancelled") == b"1",
        )

    async def rollout_for_key(self, key_digest: str) -> str | None:
        value = await self._cmd("GET", f"{self.prefix}k:{key_digest}")
        return value.decode() if value is not None else None

    async def _save(self, rollout_id: str, counters: RolloutCounters, cancel: bool) -> int:
        args = [orjson.dumps(counters), self.ttl_ms, "1" if cancel else "0", self.channel,
                rollout_id]  # fmt: skip
        reply = await self._run("SAVE", self._keys(rollout_id), args)
        if reply[0] == b"gone":
            raise UnknownRolloutError(rollout_id)
        return int(reply[1])

    async def save_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        return await self._save(rollout_id, counters, cancel=False)

    async def cancel_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        return await self._save(rollout_id, counters, cancel=True)

    async def delete_rollout(self, rollout_id: str) -> bool:
        keys = [*self._keys(rollout_id), f"{self.prefix}exits"]
        existed = await self._run("DELETE", keys, [self.channel, rollout_id])
        self._stop_renewing(rollout_id)
        return bool(existed)

    # -- turns ---------------------------------------------------------------------------

    async def claim_turn(self, rollout_id: str, owner: str, lease_s: float) -> int:
        lease_ms = int((lease_s or self.lease_s) * 1000)
        keys = self._keys(rollout_id)
        while True:
            # Subscribed before asking: a release between the answer and the wait wakes it.
            waker = self._wakers.setdefault(rollout_id, asyncio.Event())
            reply = await self._run("CLAIM", keys, [owner, lease_ms, self.ttl_ms])
            if reply[0] == b"gone":
                raise UnknownRolloutError(rollout_id)
            if reply[0] == b"ok":
                self._owners[rollout_id] = owner
                self._renew_later(rollout_id, owner, lease_ms)
                return int(reply[1])
            left_s = max(0.0, int(reply[1]) / 1000)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(RECHECK_S, left_s + 0.01)):
                    await waker.wait()

    def _renew_later(self, rollout_id: str, owner: str, lease_ms: int) -> None:
        """Renew the lease every third of its length while the turn runs (no task at all
        for a turn shorter than that)."""

        def renew() -> None:
            task = asyncio.ensure_future(self._renew(rollout_id, owner, lease_ms))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

        self._stop_renewing(rollout_id)
        loop = asyncio.get_running_loop()
        self._renewers[rollout_id] = loop.call_later(lease_ms / 3000, renew)

    async def _renew(self, rollout_id: str, owner: str, lease_ms: int) -> None:
        if self._owners.get(rollout_id) != owner:
            return
        keys = [self._keys(rollout_id)[2]]
        with contextlib.suppress(StoreUnavailableError):
            if not await self._run("RENEW", keys, [owner, lease_ms]):
                return  # lost: the commit says so
        if self._owners.get(rollout_id) == owner:
            self._renew_later(rollout_id, owner, lease_ms)

    def _stop_renewing(self, rollout_id: str) -> None:
        handle = self._renewers.pop(rollout_id, None)
        if handle is not None:
            handle.cancel()

    async def release_turn(self, rollout_id: str, owner: str) -> None:
        if self._owners.get(rollout_id) == owner:
            del self._owners[rollout_id]
            self._stop_renewing(rollout_id)
        await self._run("RELEASE", [self._keys(rollout_id)[2]], [owner, self.channel, rollout_id])

    async def commit_turn(self, rollout_id: str, commit: TurnCommit) -> int:
        step = codec.encode_step(commit.step.delta())
        answer_key, body, prompt_step = "", b"", ""
        if commit.answer is not None:
            key = commit.answer.key
            answer_key = orjson.dumps(
                [key.fingerprint.hex(), key.idempotency_key, key.finished_at, key.step]
            ).decode()
            if commit.answer.without_prompt_ids is not None:
                body, prompt_step = commit.answer.without_prompt_ids, str(key.step)
            else:
                raw = commit.answer.body
                body = raw if isinstance(raw, bytes) else orjson.dumps(raw)
        owner = self._owners.get(rollout_id, "")
        args = [owner, commit.index, step, orjson.dumps(commit.counters), self.ttl_ms,
                answer_key, body, prompt_step]  # fmt: skip
        reply = await self._run("COMMIT", self._keys(rollout_id), args)
        outcome = reply[0]
        if outcome == b"ok":
            return int(reply[1])
        if outcome == b"gone":
            raise UnknownRolloutError(rollout_id)
        if outcome == b"lost":
            raise TurnConflictError(
                f"rollout {rollout_id}: this gateway's claim on the turn expired before its "
                "commit (another gateway may run it)"
            )
        raise TurnConflictError(
            f"rollout {rollout_id}: step {commit.index} committed on {int(reply[1])} stored steps"
        )

    async def load_steps(self, rollout_id: str, start: int = 0) -> list[StepDelta]:
        raw = await self._cmd("LRANGE", self._keys(rollout_id)[1], start, -1)
        try:
            return [codec.decode_step(entry) for entry in raw]
        except (ValueError, KeyError, TypeError) as exc:
            raise seam.StoreCorruptError(f"rollout {rollout_id}: damaged step ({exc})") from exc

    async def load_answer(self, rollout_id: str) -> StoredAnswer | None:
        body, prompt_step = await self._cmd("HMGET", self._keys(rollout_id)[0], "a_body", "a_pstep")
        if not body:
            return None
        return StoredAnswer(body, int(prompt_step) if prompt_step else None)

    # -- exit reports and the policy version ---------------------------------------------

    async def save_exit(self, report: ExitReport) -> None:
        """Kept by :meth:`report_exit`, which numbers reports for every gateway."""
        await self.report_exit(report["rollout_id"], report["exit_code"])

    async def report_exit(self, rollout_id: str, exit_code: int | None) -> int:
        """Keep an exit report, numbered once for every gateway; its number."""
        p = self.prefix
        keys = [f"{p}exits", f"{p}exits:stream", f"{p}exits:seq"]
        code = "" if exit_code is None else str(exit_code)
        return int(await self._run("EXIT", keys, [rollout_id, code, EXITS_STREAM_LEN]))

    async def forget_exit(self, rollout_id: str) -> None:
        await self._cmd("HDEL", f"{self.prefix}exits", rollout_id)

    async def _load_exits(self) -> tuple[list[ExitReport], int]:
        stored = await self._cmd("HGETALL", f"{self.prefix}exits")
        cursor = await self._cmd("GET", f"{self.prefix}exits:seq")
        reports: list[ExitReport] = []
        for rid, value in stored.items():
            seq, _, code = value.decode().partition(" ")
            reports.append(
                {"rollout_id": rid.decode(), "exit_code": int(code) if code else None,
                 "seq": int(seq)}
            )  # fmt: skip
        reports.sort(key=lambda r: r["seq"])
        return reports, int(cursor or 0)

    async def follow_exits(self, after: int) -> AsyncIterator[ExitReport]:
        """Every exit report numbered above ``after``, as gateways keep them (waits for
        new ones; reconnects after Redis comes back). Deleted rollouts' reports may come
        too: the reader drops reports of rollouts it does not know."""
        last = f"{after}-1".encode() if after else b"0-0"
        stream = f"{self.prefix}exits:stream"
        while True:
            try:
                reply = await self.client.execute_command(
                    "XREAD", "COUNT", 1000, "BLOCK", 5000, "STREAMS", stream, last
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("redis exit stream lost (%s); reconnecting", exc)
                await asyncio.sleep(RECHECK_S * 2)
                continue
            for entry_id, fields in reply[0][1] if reply else ():
                last = entry_id
                code = fields[b"code"]
                yield {
                    "rollout_id": fields[b"rid"].decode(),
                    "exit_code": int(code) if code else None,
                    "seq": int(entry_id.split(b"-")[0]),
                }

    async def announce_policy(self, version: int, at: float) -> PolicyState:
        reply = await self._run(
            "ANNOUNCE", [f"{self.prefix}policy"], [version, repr(at), self.channel]
        )
        return PolicyState(int(reply[0]), float(reply[1]))

    async def load_policy(self) -> PolicyState:
        version, at = await self._cmd("HMGET", f"{self.prefix}policy", "version", "updated_at")
        if version is None:
            return PolicyState()
        return PolicyState(int(version), float(at))


async def check_redis(url: str, *, prefix: str = "rg:", timeout_s: float = 5.0) -> None:
    """Open and close the store at ``url`` (``serve --redis`` does it before serving).
    Raises :class:`StoreUnavailableError` or :class:`StoreVersionError`."""
    store = RedisStore(url, prefix=prefix, timeout_s=timeout_s)
    try:
        await store.open()
    finally:
        await store.close()


__all__ = ["LAYOUT", "RECHECK_S", "RedisStore", "check_redis"]
