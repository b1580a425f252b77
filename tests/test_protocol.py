"""Protocol helpers: rollout ids, gateway roots, paths."""

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


def test_flatten_sampling_args_has_one_precedence_for_every_side():
    from rollout_gateway.protocol import flatten_sampling_args

    env = {"temperature": 0.1, "extra_body": {"top_k": 20, "temperature": 9.9}, "seed": None}
    rollout = {"temperature": 0.7, "n": 2, "extra_body": {"min_p": 0.05}}
    # Top-level beats extra_body within a source; later sources beat earlier; None skipped.
    # ``n`` is kept: the gateway honours a registered n (the 0.3 mixin drops verifiers' n).
    assert flatten_sampling_args(env, rollout) == {
        "temperature": 0.7,
        "top_k": 20,
        "min_p": 0.05,
        "n": 2,
    }
    assert flatten_sampling_args(None, {}) == {}


def test_common_prefix_len_of_lists_and_id_arrays():
    from array import array

    from rollout_gateway.protocol import common_prefix_len

    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3  # an extension
    assert common_prefix_len([1, 2, 3, 4], [1, 2]) == 2
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # a fork
    assert common_prefix_len([], [1]) == 0 and common_prefix_len([5], [6]) == 0
    ids = array("i", range(1000))
    forked = array("i", [*range(617), -1, *range(618, 1000)])
    assert common_prefix_len(ids, forked) == 617
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert common_prefix_len(messages, [messages[0], {"role": "assistant", "content": "c"}]) == 1
