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
every write and claim). A turn's lease (:mod:`.leases`) lasts ``lease_s`` and is renewed
while its turn runs: a gateway killed mid-turn leaves it to expire, and the rollout's next
request, on any gateway, then claims it. A turn is two round trips: the claim, which reads
along what changed since this gateway's copy (:mod:`.copies`), and the commit, which ends
the claim. What other gateways change reaches this one through the events channel
(:mod:`.events`). A lost connection is :class:`StoreUnavailableError` (the request gets a
503 its client retries; :mod:`.connection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import StepDelta
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.redis_backend.connection import RedisConnection
from rollout_gateway.server.state.redis_backend.copies import (
    HeldCopies,
    attach_check,
    encode_check,
)
from rollout_gateway.server.state.redis_backend.events import RECHECK_S, EventListener
from rollout_gateway.server.state.redis_backend.exits import ExitReports
from rollout_gateway.server.state.redis_backend.leases import Leases
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
    StoreVersionError,
    TurnCommit,
    TurnConflictError,
    UnknownRolloutError,
)

#: The layout of what this code writes; another is refused, never misread (2: steps and
#: answers in :data:`~..codec.FORMAT_VERSION` 2).
LAYOUT = 2
#: The rollout hash's fields a row is made of (not the stored answer's body), and the
#: last step's check state (read along with the steps, not part of the row).
_ROW_FIELDS = ("v", "reg", "counters", "rev", "steps", "cancelled", "a_key", "a_dlv", "chk")


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
        self.channel = f"{prefix}events"
        self.connection = RedisConnection(url, timeout_s=timeout_s)
        self._secret = b""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._contents: StoreContents | None = None
        #: The exit reports every gateway shares.
        self.exits = ExitReports(self.connection, prefix, self.channel)
        self._listener = EventListener(
            self.connection, self.channel, load_policy=self.load_policy,
            exits_after=self.exits_after,
        )  # fmt: skip
        self._leases = Leases(self._renew)
        #: What this gateway holds of each rollout (a claim reads what changed along).
        self._copies = HeldCopies()

    # -- plumbing ------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """redis-py's client of the running event loop."""
        return self.connection.client

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self.connection.run(name, keys, args)

    async def _cmd(self, *command: Any) -> Any:
        return await self.connection.cmd(*command)

    @property
    def where(self) -> str:
        """Where the Redis is, for messages (no password)."""
        return self.connection.where

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
        exits, cursor = await self.exits.load()
        self._contents = StoreContents(
            policy=await self.load_policy(), exits=exits, exit_cursor=cursor
        )
        self._listener.start(cursor)
        return self._contents

    def _forget_loop(self) -> None:
        """Drop what belongs to an event loop that has ended (its tasks are gone with it;
        its connections cannot be used by another loop)."""
        self._leases.stop_all()
        self._listener.forget()
        self.connection.forget()
        self._contents = None

    async def close(self) -> None:
        """Stop following changes and close the connections."""
        self._leases.stop_all()
        await self._listener.stop()
        await self.connection.aclose()
        self._contents = None
        self._loop = None

    def watch(self, events: StoreEvents) -> None:
        """Tell ``events`` of exit reports, removed rollouts and policy announcements
        (from :meth:`open` on: call before it). A store nobody watches (``serve``'s
        start-up check) does not listen, and runs no task of its own."""
        self._listener.events = events

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
        layout, reg, counters, rev, steps, cancelled, a_key, a_dlv = values[:8]
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
        self._leases.dropped(rollout_id)
        self._copies.forget(rollout_id)
        return bool(existed)

    # -- turns ---------------------------------------------------------------------------

    async def claim_turn(self, rollout_id: str, owner: str, lease_s: float) -> int:
        """Take the lease (at most ``lease_s``, at most the store's own lease, renewed
        while held), waiting while another gateway holds it."""
        lease_ms = max(1, int(min(lease_s, self.lease_s) * 1000))
        keys = [*self._keys(rollout_id), f"{self.prefix}policy"]
        while True:
            waker = self._listener.waker(rollout_id)
            held = self._copies.held(rollout_id)
            args = [owner, lease_ms, self.ttl_ms, *held]
            reply = await self._run("CLAIM", keys, args)
            if reply[0] == b"gone":
                raise UnknownRolloutError(rollout_id)
            if reply[0] == b"ok":
                self._listener.done_waiting(rollout_id, waker)
                self._leases.took(rollout_id, owner, lease_ms)
                if reply[2] is not None:
                    self._listener.policy_seen(PolicyState(int(reply[2]), float(reply[3])))
                if len(reply) > 4:  # this gateway's copy is behind: what it reads next
                    fields = reply[4]
                    self._copies.read_along(rollout_id, fields, reply[5], int(held[1]), fields[8])
                return int(reply[1])
            left_s = max(0.0, int(reply[1]) / 1000)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(RECHECK_S, left_s + 0.01)):
                    await waker.wait()

    async def _renew(self, rollout_id: str, owner: str, lease_ms: int) -> bool:
        keys = [self._keys(rollout_id)[2]]
        return bool(await self._run("RENEW", keys, [owner, lease_ms]))

    async def release_turn(
        self, rollout_id: str, owner: str, *, delivered: bool | None = None
    ) -> None:
        """Drop the lease if ``owner`` holds it from this gateway (a waiting gateway is
        told), noting a delivered answer (one script; none when a commit ended the claim
        already)."""
        self._copies.settled(rollout_id)
        if self._leases.owner(rollout_id) != owner:
            return
        self._leases.dropped(rollout_id)
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
        owner = self._leases.owner(rollout_id) or ""
        releases = bool(owner) and commit.releases == owner
        counters = codec.encode_json(commit.counters)
        check = encode_check(commit.index, commit.step.check)
        args = [owner, commit.index, step, counters, self.ttl_ms, answer_key, body,
                "1" if releases else "0", "1" if commit.delivered else "0", self.channel,
                rollout_id, check]  # fmt: skip
        reply = await self._run("COMMIT", self._keys(rollout_id), args)
        outcome = reply[0]
        if outcome == b"ok":
            revision = int(reply[1])
            self._copies.wrote(rollout_id, revision, commit.index + 1)
            if releases:
                self._leases.dropped(rollout_id)
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
        along = self._copies.take_steps(rollout_id, start)
        check = None
        if along is not None:
            raw, check = along
        else:
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
        attach_check(steps, start, check)
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

    async def report_exit(self, report: ExitReport) -> ExitReport | None:
        """Keep an exit report, numbered once for every gateway (one script); every
        gateway's listener hands it to its watcher."""
        return await self.exits.report(report, self._keys(report["rollout_id"])[0])

    async def save_exit(self, report: ExitReport) -> None:
        """Keep a report numbered already (the gateways number theirs with
        :meth:`report_exit`)."""
        await self.exits.keep(report)

    async def forget_exit(self, rollout_id: str) -> None:
        """Drop the rollout's report."""
        await self.exits.forget(rollout_id)

    async def exits_after(self, after: int) -> list[ExitReport]:
        """The exit reports numbered above ``after``, oldest first (see
        :meth:`.exits.ExitReports.after`)."""
        return await self.exits.after(after)

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


__all__ = ["LAYOUT", "RedisStore"]
