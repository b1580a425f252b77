"""Optional security: per-rollout api keys (data plane) and an admin token (control plane)."""

from __future__ import annotations

from .conftest import script

MESSAGES = [{"role": "user", "content": script({"say": "hi"})}]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_keys_can_be_turned_off(make_gateway) -> None:
    gw = await make_gateway(require_rollout_keys=False)
    r = await gw.register("r1")
    assert "api_key" not in r.json()
    assert (await gw.chat("r1", MESSAGES)).status_code == 200


async def test_rollout_keys_are_on_by_default(make_gateway) -> None:
    gw = await make_gateway()
    key1 = (await gw.register("r1")).json()["api_key"]
    key2 = (await gw.register("r2")).json()["api_key"]
    assert len(key1) >= 40 and key1 != key2

    assert (await gw.chat("r1", MESSAGES, headers={"Authorization": ""})).status_code == 401
    # A key that is not r1's: the 404 of an unknown rollout (see the test below).
    assert (await gw.chat("r1", MESSAGES, headers=bearer("wrong"))).status_code == 404
    assert (await gw.chat("r1", MESSAGES, headers=bearer(key2))).status_code == 404
    r = await gw.chat("r1", MESSAGES, headers={"Authorization": key1})  # no scheme
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "unauthorized"
    assert (await gw.chat("r1", MESSAGES, headers=bearer(key1))).status_code == 200
    assert (await gw.chat("r2", MESSAGES, headers=bearer(key2))).status_code == 200
    # Rejected calls are not turns.
    assert (await gw.trajectory("r1")).json()["num_turns"] == 1


async def test_admin_token_guards_the_control_plane(make_gateway) -> None:
    gw = await make_gateway(admin_token="s3cret")
    gw.client.headers.pop("Authorization")
    ok = bearer("s3cret")
    body = {"model": "m", "sampling_params": {}, "max_turns": -1, "max_seq_len": None}
    control = [
        ("POST", "/v1/rollouts/r1/register", body),
        ("GET", "/v1/rollouts/r1/trajectory", None),
        ("POST", "/v1/rollouts/r1/cancel", None),
        ("POST", "/v1/rollouts/r1/unregister", None),
        ("GET", "/metrics", None),
    ]
    for method, path, payload in control:
        for headers in ({}, bearer("nope"), bearer("s3cret-but-longer")):
            r = await gw.client.request(method, path, json=payload, headers=headers)
            assert r.status_code == 401, (method, path, headers)
    for method, path, payload in control:
        r = await gw.client.request(method, path, json=payload, headers=ok)
        assert r.status_code == 200, (method, path, r.text)


async def test_admin_token_does_not_open_chat(make_gateway) -> None:
    gw = await make_gateway(admin_token="s3cret")
    await gw.register("r1")
    r = await gw.chat("r1", MESSAGES, headers=bearer("s3cret"))  # not the rollout's key
    assert r.status_code == 404
    assert (await gw.chat("r1", MESSAGES)).status_code == 200


async def test_a_rollout_key_cannot_tell_whether_another_rollout_exists(make_gateway) -> None:
    gw = await make_gateway()
    key1 = (await gw.register("r1")).json()["api_key"]
    await gw.register("r2")
    routes = [
        ("POST", "/v1/rollouts/{}/chat/completions", {"messages": MESSAGES}),
        ("GET", "/v1/rollouts/{}/models", None),
        ("POST", "/v1/rollouts/{}/exit", {"exit_code": 0}),
    ]
    for method, path, body in routes:
        answers = []
        for rollout_id in ("r2", "nobody"):  # registered, and not
            for token in (key1, "wrong"):
                r = await gw.client.request(
                    method, path.format(rollout_id), json=body, headers=bearer(token)
                )
                answers.append((r.status_code, r.text.replace(rollout_id, "ID")))
        assert len(set(answers)) == 1, (path, answers)
        assert answers[0][0] == 404
    assert (await gw.trajectory("r2")).json()["num_turns"] == 0
