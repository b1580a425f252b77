"""jsonio: the depth bound on request bodies, checked in C with reused wrapper chains."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_gateway.server.http.jsonio import MAX_BODY_DEPTH, TooDeepError, check_depth


def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def _check_default_bound() -> None:
    check_depth(nested(MAX_BODY_DEPTH))
    with pytest.raises(TooDeepError, match=f"deeper than {MAX_BODY_DEPTH} levels"):
        check_depth(nested(MAX_BODY_DEPTH + 1))


def test_the_bound_is_exact_call_after_call_whatever_bound_came_before() -> None:
    for _ in range(3):  # the wrapper chain of one call is reused by the next
        _check_default_bound()
    check_depth(nested(10), max_depth=10)
    with pytest.raises(TooDeepError, match="deeper than 10 levels"):
        check_depth(nested(11), max_depth=10)
    with pytest.raises(TooDeepError):
        check_depth(nested(300), max_depth=200)
    _check_default_bound()  # a chain built for another bound is not reused for this one
