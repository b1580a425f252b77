"""The exit channel's bodies: exit reports, the long-poll's answer and the stream's lines.

A report is numbered (``seq``) by the gateway; an env follows the reports from a cursor,
long-polling ``GET`` :data:`~.routes.EXITS_PATH` (:class:`ExitsResponse`) or holding its
stream open (``stream=1``: one JSON object per line, :func:`exit_stream_line` /
:func:`parse_exit_stream_line`).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, cast

import orjson

from rollout_gateway.protocol.errors import BodyError

#: The longest a long-poll of :data:`~.routes.EXITS_PATH` may wait, in seconds.
EXITS_MAX_WAIT = 30.0

#: Media type of the exit stream: newline-delimited JSON, one object per line, each an
#: :class:`ExitReport` or an :class:`ExitStreamHeartbeat`. Not SSE: the cursor already
#: is the resume point (SSE's event ids and ``retry`` would repeat it), the client is our
#: env and not a browser, and a line is one ``orjson.loads``. A gateway that does not
#: know ``stream=1`` answers the plain long-poll JSON, which a client tells apart by
#: this media type.
EXIT_STREAM_MEDIA_TYPE = "application/x-ndjson"
#: Seconds without a report after which the gateway sends a heartbeat line.
EXIT_STREAM_KEEPALIVE = 10.0
#: Seconds without any line after which a client takes the connection for dead (three
#: missed heartbeats) and reconnects from its cursor.
EXIT_STREAM_IDLE_TIMEOUT = 3 * EXIT_STREAM_KEEPALIVE
#: The longest line a client accepts (a report is about 100 bytes).
EXIT_STREAM_MAX_LINE = 64 * 1024


class ExitReport(TypedDict):
    """One report on the exit channel about a rollout's agent.

    - An agent exit, as its launch wrapper reported it: a hint, to be confirmed. The
      agent holds the key the report is made with, so the env must confirm it with the
      sandbox before it trusts it.
    - ``started``: the launch wrapper started the agent and can report its exit (it has
      an HTTP client); an env that hears nothing of the kind polls the sandbox instead.
    - ``refused``: the gateway itself refused a turn of the rollout (the refusal's code,
      :data:`~.errors.TurnRefusalCode` or ``context_length_exceeded``): the rollout is
      over and the env should stop its agent now, whatever the agent does. Only the
      gateway makes these (an agent's own report cannot carry it), and a later report of
      the agent keeps it.
    """

    rollout_id: str
    exit_code: int | None
    seq: int
    started: NotRequired[bool]
    refused: NotRequired[str]


class ExitsResponse(TypedDict):
    """Answer of the exits long-poll: reports with ``seq`` above ``after``, and the cursor."""

    exits: list[ExitReport]
    cursor: int


class ExitStreamHeartbeat(TypedDict):
    """A line of the exit stream that is not a report: the stream's cursor.

    Sent first (so a client knows the stream is served before any agent exits), then
    after every :data:`EXIT_STREAM_KEEPALIVE` s without a report. Every report up to
    ``cursor`` was sent before it, so a client resumes from it; after a gateway restart
    it is lower than the client's cursor, which then follows it down.
    """

    cursor: int


ExitStreamLine = ExitReport | ExitStreamHeartbeat
"""One line of the exit stream."""


def exit_stream_line(line: ExitStreamLine) -> bytes:
    """``line`` encoded for the exit stream (JSON and a newline)."""
    return orjson.dumps(line) + b"\n"


def parse_exit_stream_line(raw: bytes | str) -> ExitStreamLine:
    """One exit stream line, parsed and checked. Raises ``ValueError`` on anything else."""
    return check_exit_stream_line(orjson.loads(raw))


def check_exit_stream_line(data: Any) -> ExitStreamLine:
    """``data`` if it is an :class:`ExitReport` or an :class:`ExitStreamHeartbeat`.

    Raises :class:`~.errors.BodyError` (a ``ValueError``) otherwise.
    """
    if not isinstance(data, dict) or not _is_int(data.get("cursor", data.get("seq"))):
        raise BodyError("an exit stream line needs an integer 'seq' or 'cursor'")
    if "rollout_id" not in data:
        return cast(ExitStreamHeartbeat, data)
    code = data.get("exit_code")
    if not isinstance(data["rollout_id"], str) or not _is_int(data.get("seq")):
        raise BodyError("an exit report needs a string 'rollout_id' and an integer 'seq'")
    if code is not None and not _is_int(code):
        raise BodyError("an exit report's 'exit_code' must be an integer or null")
    if "refused" in data and not isinstance(data["refused"], str):
        raise BodyError("an exit report's 'refused' must be a string")
    if "started" in data and not isinstance(data["started"], bool):
        raise BodyError("an exit report's 'started' must be true or false")
    return cast(ExitReport, data)


def parse_exits_response(data: Any) -> ExitsResponse:
    """The long-poll's answer, checked: its reports each an :class:`ExitReport`, its
    cursor an integer. Raises :class:`~.errors.BodyError`."""
    if not isinstance(data, dict):
        raise BodyError("exits answer is not a JSON object")
    exits, cursor = data.get("exits"), data.get("cursor")
    if not isinstance(exits, list) or not _is_int(cursor):
        raise BodyError("exits answer lacks 'exits' or 'cursor'")
    for report in exits:
        if not isinstance(report, dict) or "rollout_id" not in report:
            raise BodyError("bad exit report: not a report")
        try:
            check_exit_stream_line(report)
        except BodyError as e:
            raise BodyError(f"bad exit report: {e}") from None
    return cast(ExitsResponse, data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = [
    "EXITS_MAX_WAIT",
    "EXIT_STREAM_IDLE_TIMEOUT",
    "EXIT_STREAM_KEEPALIVE",
    "EXIT_STREAM_MAX_LINE",
    "EXIT_STREAM_MEDIA_TYPE",
    "ExitReport",
    "ExitStreamHeartbeat",
    "ExitStreamLine",
    "ExitsResponse",
    "check_exit_stream_line",
    "exit_stream_line",
    "parse_exit_stream_line",
    "parse_exits_response",
]
