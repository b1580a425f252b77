"""The protocol's routes: rollout ids, gateway roots, paths."""

from __future__ import annotations

import pytest

from rollout_gateway import protocol


def test_rollout_ids_are_unguessable_and_url_safe():
    ids = {protocol.new_rollout_id() for _ in range(1000)}
    assert len(ids) == 1000
    for rid in ids:
        assert protocol.is_valid_rollout_id(rid)
        assert len(rid.removeprefix("rollout_")) == 32  # 128 random bits, hex


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "a b", "x" * 129, "é", "a?b"])
def test_invalid_ids_are_rejected(bad):
    assert not protocol.is_valid_rollout_id(bad)


@pytest.mark.parametrize(
    ("base", "root"),
    [
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        ("http://h:8000", "http://h:8000"),
        ("https://h/prefix/v1", "https://h/prefix"),
    ],
)
def test_gateway_root_strips_v1(base, root):
    assert protocol.gateway_root(base) == root


def test_rollout_base_url_is_what_the_openai_sdk_extends():
    assert (
        protocol.rollout_base_url("https://t.example/", "rollout_1")
        == "https://t.example/v1/rollouts/rollout_1"
    )
    assert protocol.chat_completions_path("rollout_1") == "/v1/rollouts/rollout_1/chat/completions"
