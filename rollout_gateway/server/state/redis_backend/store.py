"""Several gateways on one Redis: :class:`RedisStore`, the shared :class:`GatewayStore`.

Every gateway behind a load balancer may get any request of any rollout. Redis holds
what the gateways must not lose (redis-py's asyncio client; hiredis parses the replies
when installed); each step the gateways share is one Lua script (:mod:`.scripts`), so a
claim never races a claim, nor a commit a removal. Keys (``prefix`` first, ``rg:`` by
default): ``meta`` (layout, shared secret), ``r:{id}`` (the rollout), ``s:{id}`` (its
steps), ``lease:{id}`` (the gateway running its turn), ``k:{digest}``
(rollout of a key), ``exits`` / ``exits:stream`` / ``exits:seq`` (exit reports, numbered
once for every gateway), ``policy``, and the pub/sub channel ``events``.

What the gateways store is written as the SQLite backend writes it
(:mod:`rollout_gateway.server.state.codec`: a step's token arrays packed, 4 bytes an id;
every record sealed with a checksum, so a damaged one is refused, never served); the
scripts read none of it, only the counts and flags beside it.

A rollout idle for the TTL expires in Redis itself (its keys' ``PEXPIRE``, renewed by
every write and claim). A turn's lease lasts ``lease_s`` and is renewed while its turn
runs: a gateway killed mid-turn leaves it to expire, and the rollout's next request, on
any gateway, then claims it. A lost connection is :class:`StoreUnavailableError` (the
request gets a 503 its client retries); the client reconnects on the next call, the
event listener by itself.

Each gateway listens on the events channel (one connection): a released lease wakes the
claims waiting for it, a removal or a policy announcement is passed on, and an exit
report makes it read the reports added to the stream since the last it read (and so does
every reconnection: nothing published meanwhile is missed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import StepDelta
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.redis_backend import scripts
from rollout_gateway.server.state.redis_backend.copies import HeldCopies
from rollout_gateway.server.state.store import (
    GatewayStore,
    PolicyState,
    RolloutCounters,
    RolloutExistsError,
    RolloutRow,
    StoreContents,
    StoreCorruptError,
    StoredAnswer,
    StoreEvents,
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
#: The event listener looks whether it is asked to stop at least this often.
_LISTEN_POLL_S = 1.0
#: Exit reports read from the stream at once.
_EXITS_BATCH = 1000
#: Redis cannot serve now (not reachable, loading its data, out of memory, read-only, or
#: its disk full: ``MISCONF``): the request gets a 503 its client retries.
_UNAVAILABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    OSError,
)
_UNAVAILABLE_REPLIES = ("MISCONF", "OOM", "LOADING", "READONLY", "MASTERDOWN")
#: The rollout hash's fields a row is made of (not the stored answer's body).
_ROW_FIELDS = ("v", "reg", "counters", "rev", "steps", "cancelled", "a_key", "a_dlv")


def _unavailable(exc: Exception) -> bool:
    if isinstance(exc, _UNAVAILABLE):
        return True
    return isinstance(exc, redis_errors.ResponseError) and str(exc).startswith(_UNAVAILABLE_REPLIES)


class RedisStore(GatewayStore):
    """The state of every gateway on one Redis (``serve --redis URL``).

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://``.
        prefix: put before every key (several deployments may share one Redis).
        ttl_s: a rollout idle this long expires (the gateway's ``--rollout-ttl``).
        lease_s: a claimed turn stays claimed this long without renewal: how long a
            gateway that died mid-turn holds up its rollout. Renewed every third of it
            while the turn runs.
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
        self.timeout_s = timeout_s
        self.channel = f"{prefix}events"
        self._secret = b""
        self._client: aioredis.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._contents: StoreContents | None = None
        self._events: StoreEvents | None = None
        self._listener: asyncio.Task[None] | None = None
        self._stopping = False
        #: The newest policy version passed on to the watcher.
        self._policy_version: int | None = None
        #: The number of the last exit report handed to the watcher.
        self._exits_read = 0
        self._wakers: dict[str, asyncio.Event] = {}
        self._renewers: dict[str, asyncio.TimerHandle] = {}
        #: The owner holding each rollout's lease from this process (commit checks it).
        self._owners: dict[str, str] = {}
        #: What this gateway holds of each rollout (a claim reads what changed along).
        self._copies = HeldCopies()

    # -- plumbing ------------------------------------------------------------------------

    @property
    def client(self) -> aioredis.Redis:
        """The connection pool of this event loop (made on first use)."""
        if self._client is None:
            self._client = self._new_client()
            self._scripts = {
                name: self._client.register_script(getattr(scripts, name))
                for name in scripts.__all__
            }
        return self._client

    def _new_client(self, **options: Any) -> aioredis.Redis:
        settings: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
        }
        return aioredis.Redis.from_url(self.url, **{**settings, **options})

    def _down(self, exc: Exception) -> StoreUnavailableError:
        return StoreUnavailableError(f"redis at {self.where}: {exc}")

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        client = self.client
        try:
            return await self._scripts[name](keys=keys, args=args, client=client)
        except Exception as exc:
            if _unavailable(exc):
                raise self._down(exc) from exc
            raise

    async def _cmd(self, *command: Any) -> Any:
        try:
            return await self.client.execute_command(*command)
        except Exception as exc:
            if _unavailable(exc):
                raise self._down(exc) from exc
            raise

    @property
    def where(self) -> str:
        """Where the Redis is, for messages (no password)."""
        kw = self.client.connection_pool.connection_kwargs
        if "path" in kw:
            return str(kw["path"])
        return f"{kw.get('host', '?')}:{kw.get('port', '')}/{kw.get('db', 0)}"

    def _keys(self, rollout_id: str) -> list[str]:
        """The rollout's hash, steps list and lease, in the order the scripts take them."""
        p = self.prefix
        return [f"{p}r:{rollout_id}", f"{p}s:{rollout_id}", f"{p}lease:{rollout_id}"]

    # -- life ----------------------------------------------------------------------------

    @property
    def secret(self) -> bytes:
        """The secret in Redis's ``meta`` (made by the first gateway to open it)."""
        return self._secret

    async def open(self) -> StoreContents:
        """Check the layout, read the secret, the policy version and the exit reports,
        and start following the other gateways' changes (when watched). Idempotent on one
        event loop; on another (``serve`` checks the store before its server's loop runs)
        it starts over with new connections."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._contents is not None:
            return self._contents
        if self._loop is not None:
            self._forget_loop()
        self._loop = loop
        meta = f"{self.prefix}meta"
        await self._cmd("HSETNX", meta, "layout", LAYOUT)
        await self._cmd("HSETNX", meta, "secret", secrets.token_hex(32))
        layout, secret = await self._cmd("HMGET", meta, "layout", "secret")
        if layout is None or not layout.isdigit() or int(layout) != LAYOUT:
            raise StoreVersionError(
                f"Redis at {self.where} holds gateway state of layout "
                f"{(layout or b'?').decode(errors='replace')} under prefix {self.prefix!r}; "
                f"this gateway reads layout {LAYOUT} only (use another --redis-prefix or "
                "database, or the gateway version that wrote it)"
            )
        self._secret = bytes.fromhex(secret.decode())
        exits, cursor = await self._load_exits()
        self._contents = StoreContents(
            policy=await self.load_policy(), exits=exits, exit_cursor=cursor
        )
        self._exits_read = cursor
        if self._events is not None:  # a gateway's store: it follows the others' changes
            self._stopping = False
            self._listener = loop.create_task(self._listen(), name="redis-events")
        return self._contents

    def _forget_loop(self) -> None:
        """Drop what belongs to an event loop that has ended (its tasks are gone with it;
        its connections cannot be used by another loop)."""
        for handle in self._renewers.values():
            handle.cancel()
        self._renewers.clear()
        self._owners.clear()
        self._wakers.clear()
        self._listener = None
        self._client = None
        self._contents = None

    async def close(self) -> None:
        """Stop following changes and close the connections."""
        for handle in self._renewers.values():
            handle.cancel()
        self._renewers.clear()
        listener, self._listener = self._listener, None
        if listener is not None:
            # Asked to stop, and cancelled: a cancellation redis-py's read swallows (it
            # happens) still ends the listener at its next look at the flag.
            self._stopping = True
            listener.cancel()
            await asyncio.wait([listener], timeout=2 * _LISTEN_POLL_S)
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
        self._contents = None
        self._loop = None

    def watch(self, events: StoreEvents) -> None:
        """Tell ``events`` of exit reports, removed rollouts and policy announcements
        (from :meth:`open` on: call before it). A store nobody watches (``serve``'s
        start-up check) does not listen, and runs no task of its own."""
        self._events = events

    async def _listen(self) -> None:
        """Wake the claims waiting on a rollout when its lease is released, and pass on
        removals and policy announcements; reconnects after Redis comes back (then reads
        the policy again: an announcement may have come meanwhile)."""
        # No reply timeout: the channel may be quiet for hours; health checks find a dead
        # connection instead.
        client = self._new_client(socket_timeout=None, health_check_interval=self.timeout_s)
        try:
            while not self._stopping:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(self.channel)
                    if self._events is not None:  # what was published while away
                        self._policy_seen(await self.load_policy())
                        await self._read_exits()
                    while not self._stopping:
                        message = await pubsub.get_message(timeout=_LISTEN_POLL_S)
                        if message is not None and message.get("type") == "message":
                            await self._heard(message.get("data") or b"")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning("redis events lost (%s); reconnecting", exc)
                finally:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
                await asyncio.sleep(RECHECK_S)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _heard(self, data: bytes) -> None:
        kind, _, rollout_id = data.decode().partition(":")
        waker = self._wakers.pop(rollout_id, None) if rollout_id else None
        if waker is not None:
            waker.set()
        if self._events is None:
            return
        if kind == "d":
            self._events.rollout_removed(rollout_id)
        elif kind == "e":
            await self._read_exits()
        elif kind == "p":
            self._policy_seen(await self.load_policy())

    def _policy_seen(self, state: PolicyState) -> None:
        """Pass on a policy version newer than the last one passed on."""
        if state.version is None or self._events is None:
            return
        if self._policy_version is None or state.version > self._policy_version:
            self._policy_version = state.version
            self._events.policy_announced(state)

    async def _read_exits(self) -> None:
        """Hand the exit reports numbered after the last one read to the watcher."""
        for report in await self.exits_after(self._exits_read):
            self._exits_read = max(self._exits_read, report["seq"])
            if self._events is not None:
                self._events.exit_reported(report)

    # -- rollouts ------------------------------------------------------------------------

    async def create_rollout(self, row: RolloutRow) -> None:
        """Store a new rollout and its key's index, unless its id is taken."""
        reg = row.registration
        digest = reg.get("key_digest")
        keys = self._keys(reg["rollout_id"])
        keys.append(f"{self.prefix}k:{digest}" if digest else keys[0])
        args = [codec.encode_json(reg), codec.encode_json(row.counters), self.ttl_ms, LAYOUT,
                reg["rollout_id"]]  # fmt: skip
        if (await self._run("CREATE", keys, args))[0] == b"exists":
            raise RolloutExistsError(reg["rollout_id"])

    async def load_rollout(self, rollout_id: str) -> RolloutRow | None:
        """The stored rollout (its answer's body is read by :meth:`load_answer` only);
        what the claim just read along, when it did."""
        values = self._copies.take_row(rollout_id)
        if values is None:
            values = await self._cmd("HMGET", self._keys(rollout_id)[0], *_ROW_FIELDS)
        row = self._row_of(rollout_id, values)
        if row is not None:
            self._copies.seen(rollout_id, row.revision)
        return row

    @staticmethod
    def _row_of(rollout_id: str, values: list[Any]) -> RolloutRow | None:
        layout, reg, counters, rev, steps, cancelled, a_key, a_dlv = values
        if reg is None:
            return None
        if layout != str(LAYOUT).encode():
            raise StoreVersionError(
                f"rollout {rollout_id} is stored in layout {layout!r}, not {LAYOUT}"
            )
        what = f"rollout {rollout_id}"
        answer_key = None
        if a_key:
            answer_key = codec.decode_answer_key(a_key, f"{what}: answer key")
            answer_key.delivered = a_dlv != b"0"
        return RolloutRow(
            codec.decode_json(reg, f"{what}: registration"),
            codec.decode_json(counters, f"{what}: counters"),
            revision=int(rev),
            steps=int(steps),
            answer_key=answer_key,
            cancelled=cancelled == b"1",
        )

    async def rollout_for_key(self, key_digest: str) -> str | None:
        """The rollout id the key digest's index names."""
        value = await self._cmd("GET", f"{self.prefix}k:{key_digest}")
        return value.decode() if value is not None else None

    async def _save(self, rollout_id: str, counters: RolloutCounters, cancel: bool) -> int:
        args = [codec.encode_json(counters), self.ttl_ms, "1" if cancel else "0"]
        reply = await self._run("SAVE", self._keys(rollout_id), args)
        if reply[0] == b"gone":
            raise UnknownRolloutError(rollout_id)
        revision = int(reply[1])
        self._copies.wrote(rollout_id, revision)
        return revision

    async def save_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Replace the counters (one script)."""
        return await self._save(rollout_id, counters, cancel=False)

    async def cancel_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Mark cancelled for good and replace the counters (one script)."""
        return await self._save(rollout_id, counters, cancel=True)

    async def delete_rollout(self, rollout_id: str) -> bool:
        """Drop the rollout's keys and exit report; every gateway hears of it."""
        keys = [*self._keys(rollout_id), f"{self.prefix}exits"]
        existed = await self._run("DELETE", keys, [self.channel, rollout_id])
        self._stop_renewing(rollout_id)
        self._copies.forget(rollout_id)
        return bool(existed)

    # -- turns ---------------------------------------------------------------------------

    async def claim_turn(self, rollout_id: str, owner: str, lease_s: float) -> int:
        """Take the lease (at most ``lease_s``, at most the store's own lease, renewed
        while held), waiting while another gateway holds it."""
        lease_ms = max(1, int(min(lease_s, self.lease_s) * 1000))
        keys = [*self._keys(rollout_id), f"{self.prefix}policy"]
        while True:
            # Made before asking: a release between the answer and the wait wakes it.
            waker = self._wakers.setdefault(rollout_id, asyncio.Event())
            held = self._copies.held(rollout_id)
            args = [owner, lease_ms, self.ttl_ms, *held]
            reply = await self._run("CLAIM", keys, args)
            if reply[0] == b"gone":
                raise UnknownRolloutError(rollout_id)
            if reply[0] == b"ok":
                if self._wakers.get(rollout_id) is waker and not waker.is_set():
                    del self._wakers[rollout_id]
                self._owners[rollout_id] = owner
                self._renew_later(rollout_id, owner, lease_ms)
                if reply[2] is not None:
                    self._policy_seen(PolicyState(int(reply[2]), float(reply[3])))
                if len(reply) > 4:  # this gateway's copy is behind: what it reads next
                    self._copies.read_along(rollout_id, reply[4], reply[5], int(held[1]))
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
        try:
            if not await self._run("RENEW", keys, [owner, lease_ms]):
                return  # lost: the commit says so
        except StoreUnavailableError:
            pass  # tried again a third of a lease later; the commit fails if it ran out
        if self._owners.get(rollout_id) == owner:
            self._renew_later(rollout_id, owner, lease_ms)

    def _stop_renewing(self, rollout_id: str) -> None:
        handle = self._renewers.pop(rollout_id, None)
        if handle is not None:
            handle.cancel()

    async def release_turn(
        self, rollout_id: str, owner: str, *, delivered: bool | None = None
    ) -> None:
        """Drop the lease if ``owner`` holds it from this gateway (a waiting gateway is
        told), noting a delivered answer (one script; none when a commit ended the claim
        already)."""
        self._copies.settled(rollout_id)
        if self._owners.get(rollout_id) != owner:
            return
        del self._owners[rollout_id]
        self._stop_renewing(rollout_id)
        keys = [self._keys(rollout_id)[2], self._keys(rollout_id)[0]]
        args = [owner, self.channel, rollout_id, "1" if delivered else "0"]
        await self._run("RELEASE", keys, args)

    async def commit_turn(self, rollout_id: str, commit: TurnCommit) -> int:
        """Append the step, write the counters and the answer, while the lease is this
        gateway's and the step count is ``commit.index``, and end the claim when
        ``commit.releases`` says so (one script)."""
        step = codec.encode_step(commit.step)
        answer_key, body = b"", b""
        if commit.answer is not None:
            answer_key = codec.encode_answer_key(commit.answer.key)
            body = codec.encode_answer(commit.answer)
        owner = self._owners.get(rollout_id, "")
        releases = bool(owner) and commit.releases == owner
        counters = codec.encode_json(commit.counters)
        args = [owner, commit.index, step, counters, self.ttl_ms, answer_key, body,
                "1" if releases else "0", "1" if commit.delivered else "0", self.channel,
                rollout_id]  # fmt: skip
        reply = await self._run("COMMIT", self._keys(rollout_id), args)
        outcome = reply[0]
        if outcome == b"ok":
            revision = int(reply[1])
            self._copies.wrote(rollout_id, revision, commit.index + 1)
            if releases:
                del self._owners[rollout_id]
                self._stop_renewing(rollout_id)
            return revision
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
        """The stored steps from ``start`` (one ``LRANGE``; and, when there are none, a
        look whether the rollout is stored at all)."""
        keys = self._keys(rollout_id)
        raw = self._copies.take_steps(rollout_id, start)
        if raw is None:
            raw = await self._cmd("LRANGE", keys[1], start, -1)
            if not raw and not await self._cmd("EXISTS", keys[0]):
                raise UnknownRolloutError(rollout_id)
        try:
            steps = [
                codec.decode_step(entry, f"rollout {rollout_id}: step {index}")
                for index, entry in enumerate(raw, start)
            ]
        except (ValueError, KeyError, TypeError) as exc:  # (what the checksum let through)
            raise StoreCorruptError(f"rollout {rollout_id}: damaged step ({exc})") from exc
        self._copies.loaded(rollout_id, start, len(steps))
        return steps

    async def load_answer(self, rollout_id: str) -> StoredAnswer | None:
        """The last answer's bytes (and the step whose prompt ids it lacks)."""
        blob, key = await self._cmd("HMGET", self._keys(rollout_id)[0], "a_body", "a_key")
        if not blob or not key:
            return None
        what = f"rollout {rollout_id}: answer"
        body, without_prompt_ids = codec.decode_answer(blob, what)
        step = codec.decode_answer_key(key, f"{what} key").step
        return StoredAnswer(body, step if without_prompt_ids else None)

    # -- exit reports and the policy version ---------------------------------------------

    async def report_exit(self, rollout_id: str, exit_code: int | None) -> ExitReport:
        """Keep an exit report, numbered once for every gateway (one script); every
        gateway's listener hands it to its watcher."""
        p = self.prefix
        keys = [f"{p}exits", f"{p}exits:stream", f"{p}exits:seq", self._keys(rollout_id)[0]]
        code = "" if exit_code is None else str(exit_code)
        args = [rollout_id, code, EXITS_STREAM_LEN, self.channel]
        seq = int(await self._run("EXIT", keys, args))
        if seq == 0:
            raise UnknownRolloutError(rollout_id)
        return {"rollout_id": rollout_id, "exit_code": exit_code, "seq": seq}

    async def save_exit(self, report: ExitReport) -> None:
        """Keep a report numbered already (the gateways number theirs with
        :meth:`report_exit`)."""
        p = self.prefix
        code = "" if report["exit_code"] is None else str(report["exit_code"])
        keys = [f"{p}exits", f"{p}exits:seq"]
        await self._run("KEEP_EXIT", keys, [report["rollout_id"], report["seq"], code])

    async def forget_exit(self, rollout_id: str) -> None:
        """Drop the rollout's report."""
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

    async def exits_after(self, after: int) -> list[ExitReport]:
        """The exit reports numbered above ``after``, oldest first, as gateways kept them
        (those of rollouts removed since included; the stream keeps about
        :data:`EXITS_STREAM_LEN`)."""
        stream = f"{self.prefix}exits:stream"
        last = f"{after}-1".encode() if after else b"0-0"
        reports: list[ExitReport] = []
        while True:
            reply = await self._cmd("XREAD", "COUNT", _EXITS_BATCH, "STREAMS", stream, last)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                last = entry_id
                code = fields[b"code"]
                reports.append(
                    {"rollout_id": fields[b"rid"].decode(),
                     "exit_code": int(code) if code else None,
                     "seq": int(entry_id.split(b"-")[0])}
                )  # fmt: skip
            if len(entries) < _EXITS_BATCH:
                return reports

    async def announce_policy(self, version: int, at: float) -> PolicyState:
        """Forward only (one script); every gateway hears of a new version."""
        reply = await self._run(
            "ANNOUNCE", [f"{self.prefix}policy"], [version, repr(at), self.channel]
        )
        return PolicyState(int(reply[0]), float(reply[1]))

    async def load_policy(self) -> PolicyState:
        """The version in effect."""
        version, at = await self._cmd("HMGET", f"{self.prefix}policy", "version", "updated_at")
        if version is None:
            return PolicyState()
        return PolicyState(int(version), float(at))


__all__ = ["LAYOUT", "RECHECK_S", "RedisStore"]
