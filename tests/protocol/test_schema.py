"""The protocol's bodies: one parser per body, the same for the server and the client."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_gateway import protocol
from rollout_gateway.protocol import BodyError

KEY = "k" * 40


def test_a_register_body_is_read_with_its_defaults() -> None:
    body = protocol.parse_register_request({"model": "m", "max_turns": None, "extra": 1})
    assert body == {"model": "m", "sampling_params": {}, "max_turns": -1, "max_seq_len": None}


def test_a_register_body_keeps_every_field_it_sets() -> None:
    sent = {
        "model": "m",
        "sampling_params": {"temperature": 0.5},
        "max_turns": 3,
        "max_seq_len": 4096,
        "api_key": KEY,
        "max_total_completion_tokens": 100,
        "max_input_tokens": 0,
        "max_output_tokens": None,
    }
    body = protocol.parse_register_request(sent)
    assert body == {k: v for k, v in sent.items() if v is not None}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "the register body is not a JSON object"),
        ({"sampling_params": {}}, "'model' must be a non-empty string"),
        ({"model": ""}, "'model' must be a non-empty string"),
        ({"model": "m", "sampling_params": []}, "'sampling_params' must be an object"),
        ({"model": "m", "max_turns": "3"}, "'max_turns' must be an integer >= -1"),
        ({"model": "m", "max_turns": True}, "'max_turns' must be an integer >= -1"),
        ({"model": "m", "max_turns": -5}, "'max_turns' must be an integer >= -1"),
        ({"model": "m", "max_seq_len": 0}, "'max_seq_len' must be a positive integer or null"),
        (
            {"model": "m", "max_total_completion_tokens": 1.5},
            "'max_total_completion_tokens' must be a positive integer or null",
        ),
        ({"model": "m", "api_key": "short"}, "'api_key' must be 32-256 URL-safe characters"),
        ({"model": "m", "api_key": "x/" * 20}, "'api_key' must be 32-256 URL-safe characters"),
        (
            {"model": "m", "max_output_tokens": -1},
            "'max_output_tokens' must be a non-negative integer or null",
        ),
        (
            {"model": "m", "max_total_tokens": "3"},
            "'max_total_tokens' must be a non-negative integer or null",
        ),
    ],
)
def test_a_bad_register_body_names_its_field(body: Any, message: str) -> None:
    with pytest.raises(BodyError) as info:
        protocol.parse_register_request(body)
    assert str(info.value) == message


def test_what_the_client_builds_the_server_reads() -> None:
    sent = protocol.register_request(
        model="m", max_turns=2, api_key=KEY, extra={"max_input_tokens": 9}
    )
    assert protocol.parse_register_request(sent) == sent


def test_answers_a_client_reads() -> None:
    answer = {"rollout_id": "r", "status": "active", "model": "m", "max_turns": 1}
    assert protocol.parse_register_response(answer) is answer
    with pytest.raises(BodyError, match="non-string api_key"):
        protocol.parse_register_response({**answer, "api_key": 7})
    with pytest.raises(BodyError, match="not a JSON object"):
        protocol.parse_status_response(["cancelled"])
    assert protocol.parse_trajectory_response({"trajectory": []}) == {"trajectory": []}
    with pytest.raises(BodyError, match="'trajectory' is not a list"):
        protocol.parse_trajectory_response({"trajectory": "x"})


@pytest.mark.parametrize("version", [-1, 1.5, "3", True, None])
def test_a_policy_version_is_a_non_negative_integer(version: Any) -> None:
    with pytest.raises(BodyError, match="'version' must be a non-negative integer"):
        protocol.parse_policy_version_request({"version": version})
    assert protocol.parse_policy_version_request({"version": 0, "x": 1}) == {"version": 0}


def test_flatten_sampling_args_has_one_precedence_for_every_side() -> None:
    env = {"temperature": 0.1, "extra_body": {"top_k": 20, "temperature": 9.9}, "seed": None}
    rollout = {"temperature": 0.7, "n": 2, "extra_body": {"min_p": 0.05}}
    # Top-level beats extra_body within a source; later sources beat earlier; None skipped.
    # ``n`` is kept: the gateway honours a registered n (the 0.3 mixin drops verifiers' n).
    assert protocol.flatten_sampling_args(env, rollout) == {
        "temperature": 0.7,
        "top_k": 20,
        "min_p": 0.05,
        "n": 2,
    }
    assert protocol.flatten_sampling_args(None, {}) == {}
