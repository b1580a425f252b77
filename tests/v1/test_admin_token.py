"""verifiers v1: a gateway that refuses the env's admin token (issue 25)."""

from __future__ import annotations

import logging

import httpx
import pytest
from verifiers.v1.errors import InterceptionError

from rollout_gateway.errors import GatewayAuthError
from rollout_gateway.v1.config import GatewayInterceptionConfig
from rollout_gateway.v1.env import logs_beside_v1
from rollout_gateway.v1.errors import to_v1_error
from rollout_gateway.v1.interception import GatewayInterception


def _refuse(request: httpx.Request) -> httpx.Response:
    return httpx.Response(401, json={"error": {"message": "missing or invalid admin token"}})


async def test_with_its_url_set_a_refused_token_stops_the_env_before_any_rollout() -> None:
    interception = GatewayInterception(
        GatewayInterceptionConfig(url="http://gateway.test:8000", tunnel="direct"),
        transport=httpx.MockTransport(_refuse),
    )
    with pytest.raises(GatewayAuthError, match=r"\$ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE"):
        async with interception:
            pass
    assert interception.registrations == 0


def test_a_refused_token_is_a_non_retryable_interception_error_carrying_the_message() -> None:
    error = to_v1_error(
        GatewayAuthError("refused ...; set $ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE", status_code=401),
        "gateway setup",
    )
    assert isinstance(error, InterceptionError)
    assert (error.status_code, error.retryable) == (401, False)
    assert "ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE" in str(error)


def test_the_packages_log_records_reach_v1_s_handlers_while_the_env_serves() -> None:
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    v1 = logging.getLogger("verifiers.v1")
    handler = Collect()
    v1.addHandler(handler)
    try:
        with logs_beside_v1():
            logging.getLogger("rollout_gateway.client").error("the token was refused")
        logging.getLogger("rollout_gateway.client").error("after serving")
    finally:
        v1.removeHandler(handler)
    assert seen == ["the token was refused"]
