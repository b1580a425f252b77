"""Which per-turn env-side features gateway mode refuses (rollout_gateway.v1.features)."""

from __future__ import annotations

from types import SimpleNamespace

import verifiers.v1 as vf
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.runtime import NetworkPolicyConfig
from verifiers.v1.session import RolloutSession

from rollout_gateway.v1 import GatewayFeatureError
from rollout_gateway.v1.features import session_features, toolset_features

from .test_trace_sync import new_trace


def session(**hooks) -> RolloutSession:
    ctx = ModelContext(model="m", client=vf.EvalClientConfig(base_url="http://gw:8000/v1"))
    return RolloutSession(ctx=ctx, trace=new_trace(), **hooks)


def rewrite(request):  # an @intercept on requests
    return None


def judge(response):  # an @stop on responses
    return False


def test_a_plain_task_needs_nothing_from_the_env() -> None:
    assert session_features(session()) == []


def test_each_per_turn_hook_is_named() -> None:
    found = session_features(
        session(
            request_interceptors=[rewrite],
            response_stops=[judge],
            network_policy=NetworkPolicyConfig(allow=["example.com"]),
        )
    )
    assert found == [
        "@intercept request rewrites (rewrite)",
        "@stop hooks on responses (judge)",
        "provider-capability mediation for a restricted network policy",
    ]
    message = str(GatewayFeatureError(found))
    assert "rewrite" in message and "fallback = true" in message


def test_tool_servers_on_the_state_channel_are_named() -> None:
    class SearchToolset:
        pass

    shared = {"kb": SimpleNamespace(state_secret="s3cret"), "web": SimpleNamespace(state_secret="")}
    assert toolset_features([SearchToolset()], shared) == [
        "tool servers on the /state channel (SearchToolset)",
        "shared tool servers with state (kb)",
    ]
    assert toolset_features([], {"web": SimpleNamespace(state_secret="")}) == []
