"""The exit channel's bodies: the long-poll's answer and the stream's lines."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_gateway import protocol
from rollout_gateway.protocol import BodyError

REPORT = {"rollout_id": "r1", "exit_code": 0, "seq": 3}


def test_lines_round_trip() -> None:
    for line in (REPORT, {**REPORT, "refused": "max_turns_reached"}, {"cursor": 4}):
        assert protocol.parse_exit_stream_line(protocol.exit_stream_line(line)) == line


@pytest.mark.parametrize(
    "line",
    [
        {"rollout_id": "r1"},
        {"cursor": "1"},
        {**REPORT, "exit_code": "0"},
        {**REPORT, "refused": 1},
        {**REPORT, "started": "yes"},
        {**REPORT, "seq": True},
    ],
)
def test_a_bad_line_is_refused(line: dict[str, Any]) -> None:
    with pytest.raises(BodyError):
        protocol.check_exit_stream_line(line)


def test_the_long_poll_answer_is_checked_report_by_report() -> None:
    answer = {"exits": [REPORT], "cursor": 3}
    assert protocol.parse_exits_response(answer) == answer
    with pytest.raises(BodyError, match="lacks 'exits' or 'cursor'"):
        protocol.parse_exits_response({"exits": [], "cursor": None})
    with pytest.raises(BodyError, match="bad exit report"):
        protocol.parse_exits_response({"exits": [{**REPORT, "exit_code": "x"}], "cursor": 3})
    with pytest.raises(BodyError, match="bad exit report"):
        protocol.parse_exits_response({"exits": [{"cursor": 3}], "cursor": 3})
