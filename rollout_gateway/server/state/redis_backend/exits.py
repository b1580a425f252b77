"""The exit reports every gateway on one Redis shares: :class:`ExitReports`.

A report is numbered once for all gateways (``exits:seq``), kept per rollout (``exits``:
what a gateway starting now reads) and appended to a stream (``exits:stream``, about
:data:`EXITS_STREAM_LEN` reports), from which every gateway's listener reads the new ones
in number order (:mod:`.events`), so that a long-poll or exit stream opened on any gateway
sees every report, with the same cursors.
"""

from __future__ import annotations

import orjson

from rollout_gateway.protocol import ExitReport
from rollout_gateway.server.state.redis_backend.connection import RedisConnection
from rollout_gateway.server.state.store import UnknownRolloutError

#: Exit reports kept in the stream the gateways read (approximately).
EXITS_STREAM_LEN = 100_000
#: Exit reports read from the stream at once.
_BATCH = 1000


def _encoded(report: ExitReport) -> bytes:
    """The report as stored: its JSON without its number (the number is Redis's)."""
    return orjson.dumps({k: v for k, v in report.items() if k != "seq"})


def _decoded(blob: bytes, seq: int) -> ExitReport:
    report = orjson.loads(blob)
    report["seq"] = seq
    return report


class ExitReports:
    """The shared exit reports under ``prefix`` (``channel``: where a new one is told)."""

    def __init__(self, connection: RedisConnection, prefix: str, channel: str) -> None:
        self.connection = connection
        self.channel = channel
        self._hash = f"{prefix}exits"
        self._stream = f"{prefix}exits:stream"
        self._seq = f"{prefix}exits:seq"

    async def report(self, report: ExitReport, rollout_key: str) -> ExitReport | None:
        """Merge ``report`` over the stored one of the rollout stored at ``rollout_key``,
        number and keep it (one script); the report as kept (``None``: the merge dropped
        it). Raises :class:`UnknownRolloutError` when the rollout is not stored."""
        rollout_id = report["rollout_id"]
        keys = [self._hash, self._stream, self._seq, rollout_key]
        args = [rollout_id, _encoded(report), EXITS_STREAM_LEN, self.channel]
        reply = await self.connection.run("EXIT", keys, args)
        seq = int(reply[0])
        if seq == 0:
            raise UnknownRolloutError(rollout_id)
        if seq < 0:
            return None
        return _decoded(reply[1], seq)

    async def keep(self, report: ExitReport) -> None:
        """Keep a report numbered already (numbering goes on from it)."""
        args = [report["rollout_id"], report["seq"], _encoded(report)]
        await self.connection.run("KEEP_EXIT", [self._hash, self._seq], args)

    async def forget(self, rollout_id: str) -> None:
        """Drop the rollout's report."""
        await self.connection.cmd("HDEL", self._hash, rollout_id)

    async def load(self) -> tuple[list[ExitReport], int]:
        """Every kept report, oldest first, and the last number given."""
        stored = await self.connection.cmd("HGETALL", self._hash)
        cursor = await self.connection.cmd("GET", self._seq)
        reports: list[ExitReport] = []
        for value in stored.values():
            seq, _, blob = value.partition(b" ")
            reports.append(_decoded(blob, int(seq)))
        reports.sort(key=lambda r: r["seq"])
        return reports, int(cursor or 0)

    async def after(self, after: int) -> list[ExitReport]:
        """The reports numbered above ``after``, oldest first, as gateways kept them
        (those of rollouts removed since included)."""
        last = f"{after}-1".encode() if after else b"0-0"
        reports: list[ExitReport] = []
        while True:
            reply = await self.connection.cmd(
                "XREAD", "COUNT", _BATCH, "STREAMS", self._stream, last
            )
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                last = entry_id
                reports.append(_decoded(fields[b"r"], int(entry_id.split(b"-")[0])))
            if len(entries) < _BATCH:
                return reports


__all__ = ["EXITS_STREAM_LEN", "ExitReports"]
