"""The same agent through v1's own interception and through the gateway, side by side.

Each test runs one agent program (a real OpenAI-SDK script on v1's subprocess runtime)
on the same task and limits twice: with v1's own ``InterceptionServer`` in this process
relaying to the model, and with :class:`GatewayInterception` (the reference gateway on
loopback in front of the same model). What a trainer, its dashboards and v1's retry
rules read must agree: the stop condition, ``is_truncated``, the error types, the failed
calls and their times.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarness, FixBugHarnessConfig, FixBugTask, FixBugTaskset
from fix_bug_v1.harness import run_program
from starlette.responses import JSONResponse
from support.local_cluster import free_port
from verifiers.v1.configs.agent import TimeoutConfig
from verifiers.v1.errors import InterceptionError, ProviderError, TaskError, TunnelError
from verifiers.v1.errors import stop_condition as v1_stop
from verifiers.v1.interception import InterceptionServer

from rollout_gateway.protocol import TURN_REFUSAL_CODES, TruncationReason
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app, running_server
from rollout_gateway.v1 import ADAPTER_STOPS, feature_error, gateway_synced_agent
from rollout_gateway.v1.errors import interception_error, provider_error
from rollout_gateway.v1.stops import V1_TRUNCATING_STOPS, limit_stop, refusal_stop

from .conftest import ADMIN_TOKEN, FAST_RETRY, SpyTransport

LOG = "SIDE_BY_SIDE_LOG"


def first_task() -> FixBugTask:
    return next(iter(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1"))))


def program_harness(source: str, log: Path) -> type[FixBugHarness]:
    """A harness running ``source`` (an OpenAI-SDK agent) with ``$SIDE_BY_SIDE_LOG`` set;
    it notes when its program ended (the segment's end, however it came)."""

    class ProgramHarness(FixBugHarness):
        ended: list[float] = []

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):  # type: ignore[override]
            await runtime.write("agent.py", source.encode())
            env = {
                "OPENAI_BASE_URL": endpoint,
                "OPENAI_API_KEY": secret,
                "OPENAI_MODEL": ctx.model,
                LOG: str(log),
            }
            try:
                return await run_program(runtime, [sys.executable, "agent.py"], env)
            finally:
                type(self).ended.append(time.monotonic())

    return ProgramHarness


async def run_v1_own(model_url: str, harness: type[FixBugHarness], **cfg: Any) -> vf.Trace:
    """The agent through v1's own interception (relaying to ``model_url``)."""
    config = vf.AgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=f"{model_url}/v1"),
        harness=FixBugHarnessConfig(),
        runtime=vf.SubprocessConfig(),
        **cfg,
    )
    async with InterceptionServer(requires_tunnel=False) as server:
        agent = vf.Agent(config, interception=server)
        agent.harness = harness(agent.harness.config)
        async with agent:
            return await agent.run(first_task())


@contextlib.asynccontextmanager
async def gateway_interception(gateway_url: str, **options: Any) -> AsyncIterator[Any]:
    from rollout_gateway.v1 import GatewayInterception, GatewayInterceptionConfig

    spy = SpyTransport()
    interception = GatewayInterception(
        GatewayInterceptionConfig(tunnel="direct", url=gateway_url, **options),
        transport=spy,
        retry=FAST_RETRY,
        admin_token=ADMIN_TOKEN,
    )
    try:
        async with interception:
            yield interception
    finally:
        await spy.aclose()


async def run_gateway(
    gateway_url: str, harness: type[FixBugHarness], *, interception: Any = None, **cfg: Any
) -> vf.Trace:
    """The agent through the gateway at ``gateway_url``."""
    config = vf.AgentConfig(
        model="scripted",
        client=vf.EvalClientConfig(base_url=f"{gateway_url}/v1"),
        harness=FixBugHarnessConfig(),
        runtime=vf.SubprocessConfig(),
        **cfg,
    )
    async with contextlib.AsyncExitStack() as stack:
        if interception is None:
            interception = await stack.enter_async_context(gateway_interception(gateway_url))
        agent = vf.Agent(config, interception=interception)
        agent.harness = harness(agent.harness.config)
        gateway_synced_agent(agent, interception)
        async with agent:
            return await agent.run(first_task())


@contextlib.asynccontextmanager
async def model_and_gateway(
    model_app: Any = None, **gateway: Any
) -> AsyncIterator[tuple[str, str, Any]]:
    async with running_server(model_app or create_scripted_model_app()) as model_root:
        app = create_app(
            GatewayConfig.from_fields(
                upstreams=[f"{model_root}/v1"], admin_token=ADMIN_TOKEN, **gateway
            )
        )
        async with running_server(app) as gateway_root:
            yield model_root, gateway_root, app.state.gateway


def outcome(trace: vf.Trace) -> dict[str, Any]:
    """What a trainer and its dashboards read of a trace."""
    failed = [c for c in trace.calls if c.error is not None]
    return {
        "stop": trace.stop_condition,
        "is_truncated": trace.is_truncated,
        "ok": trace.ok,
        "error": (trace.last_error.type, trace.last_error.status_code) if trace.errors else None,
        "errors": len(trace.errors),
        "failed_calls": [(c.error.type, c.error.status_code) for c in failed],
        "turns": trace.num_turns,
    }


# 1 -------------------------------------------------------------- an inference outage

_SDK_AGENT = """
import os, openai
client = openai.OpenAI()  # the SDK's defaults: two retries of a 5xx or connection error
client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                               messages=[{"role": "user", "content": "hi"}])
"""


async def test_an_inference_outage_is_a_provider_error_as_with_v1s_own_interception(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the engine is down
    harness = program_harness(_SDK_AGENT, tmp_path / "log")
    own = await run_v1_own(dead, harness)
    config = GatewayConfig(upstreams=[f"{dead}/v1"], admin_token=ADMIN_TOKEN)
    async with running_server(create_app(config)) as gateway_root:
        via_gateway = await run_gateway(gateway_root, harness)

    expected = {
        "stop": "provider_error",  # not harness_error: the engine failed, not the agent
        "is_truncated": False,
        "ok": False,
        "error": ("ProviderError", 503),
        "errors": 1,
        "failed_calls": [("ProviderError", 503)] * 3,  # the SDK's three attempts
        "turns": 0,
    }
    assert outcome(own) == expected
    assert outcome(via_gateway) == expected
    # Each failed call carries the time it was made, within the agent's run.
    for trace in (own, via_gateway):
        spans = [c.time for c in trace.calls]
        assert all(s.start and s.end and s.start <= s.end for s in spans)
        assert [s.start for s in spans] == sorted(s.start for s in spans)
        assert trace.timing.agent.start <= spans[0].start <= spans[-1].end <= trace.timing.agent.end


# 2 -------------------------------------------------------------- context limits

_CHAT_AGENT = """
import os, openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "hello " * 20}]
for _ in range(10):
    try:
        answer = client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                                messages=messages)
    except openai.APIStatusError:
        break  # a refusal or an overflow ends the run, as v1's own chat loop does
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "more " * 20}]
"""


async def test_the_registered_max_seq_len_is_truncation_as_v1_counts_it(tmp_path: Path) -> None:
    harness = program_harness(_CHAT_AGENT, tmp_path / "log")
    async with model_and_gateway() as (_, gateway_root, _gw):
        async with gateway_interception(gateway_root, max_seq_len=60) as interception:
            trace = await run_gateway(gateway_root, harness, interception=interception)
    assert trace.ok, trace.errors
    # v1 bounds a rollout's tokens only by total: the context bound is that limit, and
    # v1's Trace.is_truncated counts it.
    assert trace.stop_condition == "max_total_tokens"
    assert trace.is_truncated is True
    assert trace.num_turns >= 1


def _overflowing_model(limit: int) -> Any:
    """The scripted model behind an engine context of ``limit`` tokens (vLLM's 400)."""
    scripted = create_scripted_model_app()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            words = sum(
                len(str(m.get("content") or "").split()) for m in json.loads(body)["messages"]
            )
            if words > limit:
                error = {
                    "error": {
                        "message": f"This model's maximum context length is {limit} tokens. "
                        f"However, your prompt contains at least {words} input tokens.",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                }
                await JSONResponse(error, status_code=400)(scope, receive, send)
                return

            async def replay() -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            await scripted(scope, replay, send)
            return
        await scripted(scope, receive, send)

    return app


async def test_the_engines_context_overflow_is_truncation_and_the_same_failed_call(
    tmp_path: Path,
) -> None:
    harness = program_harness(_CHAT_AGENT, tmp_path / "log")
    async with running_server(_overflowing_model(50)) as model_root:
        own = await run_v1_own(model_root, harness)
        config = GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=ADMIN_TOKEN)
        async with running_server(create_app(config)) as gateway_root:
            via_gateway = await run_gateway(gateway_root, harness)
    # The same exchanges: two answered turns, then the engine's 400, one failed call.
    for trace in (own, via_gateway):
        assert trace.ok, trace.errors
        assert trace.num_turns == 2
        assert [(c.error.type, c.error.status_code) for c in trace.calls if c.error] == [
            ("ProviderError", 400)
        ]
    # v1's own interception calls that rollout complete; in gateway mode the gateway
    # ended it at the engine's context, and reports it as the truncation v1 counts.
    assert (own.stop_condition, own.is_truncated) == ("agent_completed", False)
    assert (via_gateway.stop_condition, via_gateway.is_truncated) == ("max_total_tokens", True)


# 3 -------------------------------------------------------------- only v1's own stop names

#: The stop names v1 itself sets (verifiers 0.4): its limits, the agent's completion, a
#: stage timeout, and ``<boundary>_error`` of each of its error types.
V1_STOPS = {
    *V1_TRUNCATING_STOPS,
    "agent_completed",
    "user_closed",
    *(f"{stage}_timeout" for stage in ("setup", "agent", "finalize", "scoring")),
    *(v1_stop(cls("x")) for cls in (ProviderError, InterceptionError, TunnelError, TaskError)),
    "harness_error",
    "sandbox_error",
}


def test_every_stop_the_adapter_can_set_is_one_v1_knows() -> None:
    assert ADAPTER_STOPS <= V1_STOPS, ADAPTER_STOPS - V1_STOPS
    for reason in TruncationReason.__args__:  # type: ignore[attr-defined]
        assert limit_stop(reason) in V1_TRUNCATING_STOPS, reason
    assert limit_stop("a_reason_of_another_gateway") in V1_TRUNCATING_STOPS
    for code in TURN_REFUSAL_CODES:
        stop = refusal_stop(code)
        assert stop is None or stop in V1_TRUNCATING_STOPS, code
    # Every error class the adapter records is v1's own, so its stop is v1's name.
    raised = [
        interception_error("x"),
        TunnelError("x"),
        provider_error({"type": "connect", "message": "x"}),
        feature_error(["@stop hooks on the live trace (f)"]),
    ]
    assert {v1_stop(e) for e in raised} <= ADAPTER_STOPS


# 4 -------------------------------------------------------------- one failure, once

_SLOW_TWO_TURN_AGENT = """
import os, time, openai
client = openai.OpenAI(max_retries=0)
client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                               messages=[{"role": "user", "content": "hi"}])
open(os.environ["SIDE_BY_SIDE_LOG"], "w").write("turn 1 done")
time.sleep(2)  # meanwhile the gateway drops the rollout (its idle TTL)
"""


async def test_a_rollout_the_gateway_dropped_records_its_interception_error_once(
    tmp_path: Path,
) -> None:
    log = tmp_path / "log"
    harness = program_harness(_SLOW_TWO_TURN_AGENT, log)
    async with model_and_gateway() as (_, gateway_root, gw):
        run = asyncio.ensure_future(run_gateway(gateway_root, harness))
        for _ in range(400):
            if log.exists():
                break
            await asyncio.sleep(0.02)
        for record in gw.registry.records():  # as the idle TTL would
            gw.registry.remove(record.rollout_id)
        trace = await asyncio.wait_for(run, 60)
    assert not trace.ok
    assert [e.type for e in trace.errors] == ["InterceptionError"]  # once, not twice
    assert trace.stop_condition == "interception_error"


# 5 -------------------------------------------------------------- the turns' own times

_PAUSING_AGENT = """
import os, time, openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "hi"}]
for _ in range(3):
    answer = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "again"}]
    time.sleep(0.4)  # the harness's own work between turns
"""


async def test_nodes_carry_the_turns_real_times_as_with_v1s_own_interception(
    tmp_path: Path,
) -> None:
    harness = program_harness(_PAUSING_AGENT, tmp_path / "log")
    async with model_and_gateway() as (model_root, gateway_root, _):
        own = await run_v1_own(model_root, harness)
        via_gateway = await run_gateway(gateway_root, harness)
    for trace in (own, via_gateway):
        assert trace.ok, trace.errors
        stamps = [n.timestamp for n in trace.nodes if n.sampled]
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert len(stamps) == 3 and all(gap >= 0.35 for gap in gaps), gaps
        # A turn's node is stamped when its answer came back (its call's end).
        ends = [c.time.end for c in trace.calls]
        assert all(abs(s - e) < 0.1 for s, e in zip(stamps, ends, strict=True)), (stamps, ends)
        assert trace.timing.agent.start <= stamps[0] and stamps[-1] <= trace.timing.agent.end


# 6 -------------------------------------------------------------- refusals end the agent

_RETRY_FOREVER_AGENT = """
import os, time, openai
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "hi"}]
log = open(os.environ["SIDE_BY_SIDE_LOG"], "a")
while True:  # retries every error, forever (as agent frameworks retry a 4xx they wrap)
    log.write(f"{time.monotonic()} call\\n"); log.flush()
    try:
        answer = client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                                messages=messages)
    except Exception as e:
        log.write(f"{time.monotonic()} {type(e).__name__}\\n"); log.flush()
        time.sleep(0.02)
        continue
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "again"}]
"""


def calls_and_errors(log: Path) -> tuple[list[float], list[str]]:
    """When the agent sent each call, and the errors it got (in order)."""
    calls: list[float] = []
    errors: list[str] = []
    for line in log.read_text().splitlines():
        stamp, what = line.split()
        if what == "call":
            calls.append(float(stamp))
        else:
            errors.append(what)
    return calls, errors


async def test_a_refused_turn_stops_an_agent_that_retries_forever(tmp_path: Path) -> None:
    own_log, gateway_log = tmp_path / "own", tmp_path / "gateway"
    own_harness = program_harness(_RETRY_FOREVER_AGENT, own_log)
    gateway_harness = program_harness(_RETRY_FOREVER_AGENT, gateway_log)
    async with model_and_gateway() as (model_root, gateway_root, _):
        # v1's own interception refuses turn 3 (stop max_turns) but cannot end a program
        # that keeps retrying: it runs until the agent's time limit (long enough for a
        # loaded machine to start the program and make its refused calls).
        own = await run_v1_own(
            model_root, own_harness, max_turns=2, timeout=TimeoutConfig(rollout=10)
        )
        via_gateway = await run_gateway(gateway_root, gateway_harness, max_turns=2)

    assert (own.stop_condition, own.is_timeout) == ("agent_timeout", True)
    own_calls, own_errors = calls_and_errors(own_log)
    assert set(own_errors) == {"BadRequestError"} and len(own_calls) > 3  # retried on
    # The gateway refused turn 3 (403), reported it on the exit channel, and the env
    # ended the program within a second: the limit is the stop, scored, v1's name.
    assert via_gateway.ok, via_gateway.errors
    assert via_gateway.stop_condition == "max_turns" and via_gateway.is_truncated
    assert via_gateway.num_turns == 2 and "tests_pass" in via_gateway.rewards
    # The refused call is the third: the refusal came after it was sent.
    calls, errors = calls_and_errors(gateway_log)
    assert set(errors) <= {"PermissionDeniedError"}  # 403 turn_refused, if it saw one
    stopped_at = gateway_harness.ended[-1]
    assert stopped_at - calls[2] < 1.0, stopped_at - calls[2]
    assert not via_gateway.is_timeout


@pytest.mark.parametrize("limit", ["max_output_tokens"])
async def test_a_token_limit_refusal_stops_the_retrying_agent_too(
    tmp_path: Path, limit: str
) -> None:
    log = tmp_path / "log"
    harness = program_harness(_RETRY_FOREVER_AGENT, log)
    async with model_and_gateway() as (_, gateway_root, _gw):
        trace = await run_gateway(gateway_root, harness, **{limit: 1})
    assert trace.ok and trace.stop_condition == limit and trace.is_truncated
    calls, _ = calls_and_errors(log)
    assert harness.ended[-1] - calls[1] < 1.0  # refused at its second call (soft by one)
