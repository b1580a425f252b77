"""Several gateways on one Redis: :class:`RedisStore`, what they keep there.

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
every write and claim). Who runs a turn, the numbering of exit reports and what other
gateways change are :mod:`.coordinator`'s (:class:`~.coordinator.RedisCoordinator`, one per
gateway, made by :func:`~rollout_gateway.server.state.backends.coordinator_for`). A turn
is two round trips: the claim, which reads
along what changed since this gateway's copy, and the commit, which ends the claim (the
store keeps the turn leases this gateway holds, :mod:`.leases`, for that). A lost
connection is :class:`StoreUnavailableError` (the request gets a 503 its client retries;
:mod:`.connection`).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.recording.steps import StepDelta
from rollout_gateway.server.state import codec
from rollout_gateway.server.state.redis_backend.check_state import attach_check, encode_check
from rollout_gateway.server.state.redis_backend.connection import RedisConnection
from rollout_gateway.server.state.redis_backend.exits import ExitReports
from rollout_gateway.server.state.redis_backend.leases import Leases
from rollout_gateway.server.state.store import (
    PolicyState,
    RolloutCounters,
    RolloutExistsError,
    RolloutRow,
    RolloutStore,
    StoreContents,
    StoreCorruptError,
    StoredAnswer,
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
ROW_FIELDS = ("v", "reg", "counters", "rev", "steps", "cancelled", "a_key", "a_dlv", "chk")


class RedisStore(RolloutStore):
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
        self._contents: StoreContents | None = None
        #: The exit reports every gateway shares.
        self.exits = ExitReports(self.connection, prefix, self.channel)
        #: The turn leases this gateway holds (a commit ends its claim).
        self.leases = Leases(self._renew)

    # -- plumbing ------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """redis-py's client."""
        return self.connection.client

    async def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run the script ``name`` of :mod:`.scripts`."""
        return await self.connection.run(name, keys, args)

    async def _cmd(self, *command: Any) -> Any:
        return await self.connection.cmd(*command)

    @property
    def where(self) -> str:
        """Where the Redis is, for messages (no password)."""
        return self.connection.where

    def keys(self, rollout_id: str) -> list[str]:
        """The rollout's hash, steps list and lease, in the order the scripts take them."""
        p = self.prefix
        return [f"{p}r:{rollout_id}", f"{p}s:{rollout_id}", f"{p}lease:{rollout_id}"]

    # -- life ----------------------------------------------------------------------------

    @property
    def secret(self) -> bytes:
        """The secret in Redis's ``meta`` (made by the first gateway to open it)."""
        return self._secret

    async def open(self) -> StoreContents:
        """Check the layout, read the secret, the policy version and the exit reports.
        Idempotent: a second call returns what the first found."""
        if self._contents is not None:
            return self._contents
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
        return self._contents

    async def close(self) -> None:
        """Stop renewing leases and close the connections."""
        self.leases.stop_all()
        await self.connection.aclose()
        self._contents = None

    # -- rollouts ------------------------------------------------------------------------

    async def create_rollout(self, row: RolloutRow) -> None:
        """Store a new rollout and its key's index, unless its id is taken."""
        reg = row.registration
        digest = reg.get("key_digest")
        keys = self.keys(reg["rollout_id"])
        keys.append(f"{self.prefix}k:{digest}" if digest else keys[0])
        args = [codec.encode_json(reg), codec.encode_json(row.counters), self.ttl_ms, LAYOUT,
                reg["rollout_id"]]  # fmt: skip
        if (await self.run("CREATE", keys, args))[0] == b"exists":
            raise RolloutExistsError(reg["rollout_id"])

    async def load_rollout(self, rollout_id: str) -> RolloutRow | None:
        """The stored rollout (its answer's body is read by :meth:`load_answer` only)."""
        values = await self._cmd("HMGET", self.keys(rollout_id)[0], *ROW_FIELDS)
        return self.row_of(rollout_id, values)

    async def stored_of(self, rollout_ids: list[str]) -> set[str]:
        """Which of ``rollout_ids`` are stored (one ``EXISTS`` each, sent together)."""
        found = await asyncio.gather(*(self._cmd("EXISTS", self.keys(i)[0]) for i in rollout_ids))
        return {i for i, n in zip(rollout_ids, found, strict=True) if n}

    @staticmethod
    def row_of(rollout_id: str, values: list[Any]) -> RolloutRow | None:
        """A row from the rollout hash's :data:`ROW_FIELDS` (``None``: not stored)."""
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
        reply = await self.run("SAVE", self.keys(rollout_id), args)
        if reply[0] == b"gone":
            raise UnknownRolloutError(rollout_id)
        return int(reply[1])

    async def save_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Replace the counters (one script)."""
        return await self._save(rollout_id, counters, cancel=False)

    async def cancel_rollout(self, rollout_id: str, counters: RolloutCounters) -> int:
        """Mark cancelled for good and replace the counters (one script)."""
        return await self._save(rollout_id, counters, cancel=True)

    async def delete_rollout(self, rollout_id: str) -> bool:
        """Drop the rollout's keys and exit report; every gateway hears of it."""
        keys = [*self.keys(rollout_id), f"{self.prefix}exits"]
        existed = await self.run("DELETE", keys, [self.channel, rollout_id])
        self.leases.dropped(rollout_id)
        return bool(existed)

    # -- turns ---------------------------------------------------------------------------

    async def _renew(self, rollout_id: str, owner: str, lease_ms: int) -> bool:
        keys = [self.keys(rollout_id)[2]]
        return bool(await self.run("RENEW", keys, [owner, lease_ms]))

    async def commit_turn(self, rollout_id: str, commit: TurnCommit) -> int:
        """Append the step, write the counters and the answer, while the lease is this
        gateway's and the step count is ``commit.index``, and end the claim when
        ``commit.releases`` says so (one script)."""
        step = codec.encode_step(commit.step)
        answer_key, body = b"", b""
        if commit.answer is not None:
            answer_key = codec.encode_answer_key(commit.answer.key)
            body = codec.encode_answer(commit.answer)
        owner = self.leases.owner(rollout_id) or ""
        releases = bool(owner) and commit.releases == owner
        counters = codec.encode_json(commit.counters)
        check = encode_check(commit.index, commit.step.check)
        args = [owner, commit.index, step, counters, self.ttl_ms, answer_key, body,
                "1" if releases else "0", "1" if commit.delivered else "0", self.channel,
                rollout_id, check]  # fmt: skip
        reply = await self.run("COMMIT", self.keys(rollout_id), args)
        outcome = reply[0]
        if outcome == b"ok":
            if releases:
                self.leases.dropped(rollout_id)
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
        """The stored steps from ``start`` (one ``LRANGE``; and, when there are none, a
        look whether the rollout is stored at all)."""
        keys = self.keys(rollout_id)
        raw = await self._cmd("LRANGE", keys[1], start, -1)
        if not raw and not await self._cmd("EXISTS", keys[0]):
            raise UnknownRolloutError(rollout_id)
        return self.steps_of(rollout_id, raw, start)

    @staticmethod
    def steps_of(
        rollout_id: str, raw: list[bytes], start: int, check: bytes | None = None
    ) -> list[StepDelta]:
        """Stored steps ``raw`` (from index ``start``), decoded and checked; the last one
        given its check state ``check`` when it is that step's."""
        try:
            steps = [
                codec.decode_step(entry, f"rollout {rollout_id}: step {index}")
                for index, entry in enumerate(raw, start)
            ]
        except (ValueError, KeyError, TypeError) as exc:  # (what the checksum let through)
            raise StoreCorruptError(f"rollout {rollout_id}: damaged step ({exc})") from exc
        attach_check(steps, start, check)
        return steps

    async def load_answer(self, rollout_id: str) -> StoredAnswer | None:
        """The last answer's bytes (and the step whose prompt ids it lacks)."""
        blob, key = await self._cmd("HMGET", self.keys(rollout_id)[0], "a_body", "a_key")
        if not blob or not key:
            return None
        what = f"rollout {rollout_id}: answer"
        body, without_prompt_ids = codec.decode_answer(blob, what)
        step = codec.decode_answer_key(key, f"{what} key").step
        return StoredAnswer(body, step if without_prompt_ids else None)

    # -- exit reports and the policy version ---------------------------------------------

    async def save_exit(self, report: ExitReport) -> None:
        """Keep a report numbered already (the gateways number theirs with
        :meth:`report_exit`)."""
        await self.exits.keep(report)

    async def forget_exit(self, rollout_id: str) -> None:
        """Drop the rollout's report."""
        await self.exits.forget(rollout_id)

    async def announce_policy(self, version: int, at: float) -> PolicyState:
        """Forward only (one script); every gateway hears of a new version."""
        reply = await self.run(
            "ANNOUNCE", [f"{self.prefix}policy"], [version, repr(at), self.channel]
        )
        return PolicyState(int(reply[0]), float(reply[1]))

    async def load_policy(self) -> PolicyState:
        """The version in effect."""
        version, at = await self._cmd("HMGET", f"{self.prefix}policy", "version", "updated_at")
        if version is None:
            return PolicyState()
        return PolicyState(int(version), float(at))


__all__ = ["LAYOUT", "ROW_FIELDS", "RedisStore"]
