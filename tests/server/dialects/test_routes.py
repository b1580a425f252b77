"""Which path speaks which dialect, for which rollout, and where each carries the key."""

from __future__ import annotations

import pytest

from rollout_gateway.server.dialects import DIALECTS, dialect_named, match_route


@pytest.mark.parametrize(
    ("path", "dialect", "aux", "rollout_id"),
    [
        ("/v1/rollouts/r1/chat/completions", "chat", False, "r1"),
        ("/v1/rollouts/r1/v1/messages", "anthropic", False, "r1"),
        ("/v1/rollouts/r1/v1/messages?beta=true", "anthropic", False, "r1"),
        ("/v1/rollouts/r-2_x/v1/messages/count_tokens", "anthropic", True, "r-2_x"),
        ("/v1/rollouts/r1/responses", "responses", False, "r1"),
        ("/v1/chat/completions", "chat", False, None),
        ("/v1/messages", "anthropic", False, None),
        ("/v1/messages/count_tokens?beta=true", "anthropic", True, None),
        ("/v1/responses", "responses", False, None),
    ],
)
def test_routes(path: str, dialect: str, aux: bool, rollout_id: str | None) -> None:
    route = match_route(path)
    assert route is not None
    assert (route.dialect.name, route.aux, route.rollout_id) == (dialect, aux, rollout_id)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/rollouts/r1/register",
        "/v1/rollouts/exits",
        "/v1/rollouts//v1/messages",
        "/v1/rollouts/r1/v1/v1/messages",  # ANTHROPIC_BASE_URL with /v1: not a route
        "/v1/rollouts/r1/v1/responses",
        "/v1/rollouts/r1/messages",
        "/responses",
        "/v1/models",
    ],
)
def test_other_paths_are_no_dialects(path: str) -> None:
    assert match_route(path) is None


def test_each_dialect_reads_the_key_where_its_clients_send_it() -> None:
    chat, anthropic, responses = (dialect_named(n) for n in ("chat", "anthropic", "responses"))
    assert anthropic.credential(None, "rk-1") == "rk-1"  # x-api-key (the SDK, Claude Code)
    assert anthropic.credential("Bearer rk-2", None) == "rk-2"  # ANTHROPIC_AUTH_TOKEN
    assert anthropic.credential("Bearer rk-2", "rk-1") == "rk-1"
    for dialect in (chat, responses):
        assert dialect.credential("Bearer rk-3", None) == "rk-3"
        assert dialect.credential(None, "rk-3") is None  # OpenAI clients send Bearer only
        assert dialect.credential("Basic abc", None) is None


def test_dialect_names_are_unique_and_known() -> None:
    assert [d.name for d in DIALECTS] == ["chat", "anthropic", "responses"]
    with pytest.raises(KeyError):
        dialect_named("gemini")
