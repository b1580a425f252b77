"""Contract tests: one per private dependency on verifiers v1 (``internals.PRIVATE``).

Each fails, naming the entry, when verifiers changes the private name, signature or
behaviour the adapter relies on, so an upgrade of verifiers says what to re-read instead
of failing deep inside a rollout. Every entry of the table has its test here, and
docs/v1.md lists every entry.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import subprocess
import sys
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_gateway.v1.internals import PRIVATE, PrivateDependency

DOCS = Path(__file__).resolve().parents[2] / "docs" / "v1.md"

#: The digest of v1's ``Env.serving`` source that ``GatewayEnvMixin._gateway_serving``
#: mirrors (verifiers 0.4.0). A new digest: read v1's new serving() and update the mirror.
SERVING_DIGEST = "9b21ec4ebe301a72"


def fail(entry: str, what: str) -> None:
    pytest.fail(
        f"verifiers changed {entry} ({what}); the adapter relies on it: see "
        "rollout_gateway.v1.internals.PRIVATE and docs/v1.md (private dependencies)"
    )


def source(obj: Any) -> str:
    return textwrap.dedent(inspect.getsource(obj))


def names_used(fn: Callable[..., Any]) -> set[str]:
    """Global and attribute names a function's code refers to."""
    return {
        node.attr if isinstance(node, ast.Attribute) else node.id
        for node in ast.walk(ast.parse(source(fn)))
        if isinstance(node, ast.Attribute | ast.Name)
    }


def params(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


# -- one check per entry -----------------------------------------------------------------


def check_runtime_table() -> None:
    from verifiers.v1 import runtimes

    from rollout_gateway.v1 import LocalSandboxRuntime, LocalSandboxRuntimeConfig

    name = "verifiers.v1.runtimes._runtime_cls"
    table = getattr(runtimes, "_runtime_cls", None)
    if not callable(table) or len(params(table)) != 1:
        fail(name, "no longer a function of the config")
    for caller in (runtimes.make_runtime, runtimes.runtime_is_local):
        if "_runtime_cls" not in names_used(caller):
            fail(name, f"{caller.__name__} no longer resolves runtimes through it")
    config = LocalSandboxRuntimeConfig()  # made: installed
    if runtimes._runtime_cls(config) is not LocalSandboxRuntime:
        fail(name, "the installed entry does not resolve")
    for config_cls in typing.get_args(typing.get_args(runtimes.RuntimeConfig)[0]):
        v1_config = config_cls.model_construct()
        resolved = runtimes._runtime_cls(v1_config)
        if resolved.__module__.split(".")[:3] != ["verifiers", "v1", "runtimes"]:
            fail(name, f"{config_cls.__name__} no longer resolves to v1's runtime")


def check_episode_agents() -> None:
    from verifiers.v1.env import Env

    name = "verifiers.v1.env.Env._episode_agents"
    method = getattr(Env, "_episode_agents", None)
    if method is None:
        fail(name, "gone")
    if params(method) != ["self", "ctx", "completed", "on_trace", "on_discard"]:
        fail(name, f"signature now {params(method)}")
    if "_episode_agents" not in names_used(Env.run_episode):
        fail(name, "run_episode no longer builds its agents there")


def check_serving_mirror() -> None:
    from verifiers.v1.env import Env

    digest = hashlib.sha256(inspect.getsource(Env.serving).encode()).hexdigest()[:16]
    if digest != SERVING_DIGEST:
        fail("verifiers.v1.env.Env.serving", f"its source changed (digest {digest})")


def check_env_attribute(attribute: str) -> Callable[[], None]:
    def check() -> None:
        from verifiers.v1.env import Env

        name = f"verifiers.v1.env.Env.{attribute}"
        if attribute not in names_used(Env.serving):
            fail(name, "serving() no longer sets it")
        if attribute not in names_used(Env._episode_agents):
            fail(name, "the episode's agents no longer read it")

    return check


def check_requires_tunnel() -> None:
    from verifiers.v1.env import Env

    name = "verifiers.v1.env.Env._requires_tunnel"
    method = getattr(Env, "_requires_tunnel", None)
    if method is None or params(method) != ["self", "shared"]:
        fail(name, "gone, or its signature changed")
    if "_requires_tunnel" not in names_used(Env.serving):
        fail(name, "serving() no longer decides the tunnel with it")


async def check_turn_judges_after_the_segment() -> None:
    # A segment (launch) runs to its end, then the exit is judged: the gateway's sync at
    # the end of launch lands before v1 reads the stop condition.
    from verifiers.v1.harness import HarnessSession

    order: list[str] = []

    class Recorder:
        config = SimpleNamespace(id="recorder")
        SUPPORTS_TOOL_INTERCEPTION = False

        async def launch(self, *args: Any, **kwargs: Any) -> Any:
            order.append("launch")
            return SimpleNamespace(exit_code=1, stdout="", stderr="")

        async def _check_result(self, trace: Any, runtime: Any, result: Any) -> None:
            order.append(f"judge exit {result.exit_code}")

    harness: Any = Recorder()
    session = HarnessSession(harness, None, None, None, "url", "key", {}, None)  # type: ignore[arg-type]
    await session.turn()
    if order != ["launch", "judge exit 1"]:
        fail("verifiers.v1.harness.HarnessSession.turn", f"a segment now runs {order}")


def check_harness_rebuild() -> None:
    from verifiers.v1.agent import Agent

    text = source(Agent._rollout_params)
    if "type(harness)(" not in text:
        fail("verifiers.v1.agent.Agent._rollout_params", "harnesses are rebuilt another way")


def check_resume_support() -> None:
    from verifiers.v1.agent import Agent

    text = source(Agent._check_resume_support)
    if "type(harness).resume is Harness.resume" not in text:
        fail("verifiers.v1.agent.Agent._check_resume_support", "resume support read otherwise")


def check_pending_turn() -> None:
    from verifiers.v1.graph import PendingTurn

    name = "verifiers.v1.graph.PendingTurn"
    fields = [f.name for f in dataclasses.fields(PendingTurn)]
    if fields[:5] != ["trace", "prompt", "tools", "prefix_node_ids", "path_len"]:
        fail(name, f"fields now {fields}")
    if params(PendingTurn.commit)[:2] != ["self", "response"]:
        fail(name, "commit(response) changed")


def check_message_spans() -> None:
    from verifiers.v1 import TurnTokens

    field = TurnTokens.model_fields.get("message_spans")
    if field is None or not field.exclude:
        fail("verifiers.v1.types.TurnTokens.message_spans", "gone, or now serialized")


def check_rollout_session() -> None:
    from verifiers.v1.session import RolloutLimits, RolloutSession

    name = "verifiers.v1.session.RolloutSession"
    used = {
        "ctx",
        "trace",
        "limits",
        "released",
        "error",
        "network_policy",
        "request_interceptors",
        "response_interceptors",
        "request_stops",
        "response_stops",
        "trace_stops",
    }
    missing = used - {f.name for f in dataclasses.fields(RolloutSession)}
    if missing:
        fail(name, f"no {sorted(missing)}")
    limits = {f.name for f in dataclasses.fields(RolloutLimits)}
    if not {"max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens"} <= limits:
        fail(name, f"RolloutLimits' fields now {sorted(limits)}")
    if params(RolloutLimits.reached) != ["self", "trace"]:
        fail(name, "RolloutLimits.reached(trace) changed")


def check_eval_cli() -> None:
    from rollout_gateway.v1 import eval_internals

    used = [getattr(eval_internals, name) for name in eval_internals.__all__]
    used[used.index(eval_internals.eval_resume)] = eval_internals.eval_resume.load
    for name, value in zip(eval_internals.__all__, used, strict=True):
        if not callable(value):
            fail("verifiers.v1.cli", f"{name} is no longer callable")


def check_acp_prompt_request() -> None:
    from verifiers.v1.acp import ACPHarnessSession

    name = "verifiers.v1.acp.ACPHarnessSession._request"
    method = getattr(ACPHarnessSession, "_request", None)
    if method is None:
        fail(name, "gone")
    if params(method) != ["self", "operation", "payload"]:
        fail(name, f"signature now {params(method)}")
    if '"prompt"' not in source(ACPHarnessSession._run) or "_request" not in names_used(
        ACPHarnessSession._run
    ):
        fail(name, "a prompt is no longer sent through it")


CHECKS: dict[str, Callable[[], Any]] = {
    "verifiers.v1.runtimes._runtime_cls": check_runtime_table,
    "verifiers.v1.env.Env._episode_agents": check_episode_agents,
    "verifiers.v1.env.Env.serving": check_serving_mirror,
    "verifiers.v1.env.Env._interception": check_env_attribute("_interception"),
    "verifiers.v1.env.Env._shared_tools": check_env_attribute("_shared_tools"),
    "verifiers.v1.env.Env._requires_tunnel": check_requires_tunnel,
    "verifiers.v1.harness.HarnessSession.turn": check_turn_judges_after_the_segment,
    "verifiers.v1.agent.Agent._rollout_params": check_harness_rebuild,
    "verifiers.v1.agent.Agent._check_resume_support": check_resume_support,
    "verifiers.v1.graph.PendingTurn": check_pending_turn,
    "verifiers.v1.types.TurnTokens.message_spans": check_message_spans,
    "verifiers.v1.session.RolloutSession": check_rollout_session,
    "verifiers.v1.cli": check_eval_cli,
    "verifiers.v1.acp.ACPHarnessSession._request": check_acp_prompt_request,
}


@pytest.mark.parametrize("entry", PRIVATE, ids=lambda e: e.name)
async def test_the_private_dependency_holds(entry: PrivateDependency) -> None:
    result = CHECKS[entry.name]()
    if inspect.isawaitable(result):
        await result


def test_every_private_dependency_has_its_contract_test() -> None:
    assert sorted(CHECKS) == sorted(e.name for e in PRIVATE)


def test_the_docs_list_every_private_dependency() -> None:
    text = DOCS.read_text()
    missing = [e.name for e in PRIVATE if f"`{e.name}`" not in text]
    assert missing == [], f"docs/v1.md's private-dependency table lacks {missing}"


def test_importing_the_adapter_changes_nothing_in_v1() -> None:
    # The runtime table is v1's own until something selects the local_sandbox type.
    script = (
        "import rollout_gateway.v1, rollout_gateway.v1.demo\n"
        "import verifiers.v1.runtimes as r\n"
        "assert r._runtime_cls.__module__ == 'verifiers.v1.runtimes', r._runtime_cls\n"
        "from rollout_gateway.v1 import LocalSandboxAgentConfig\n"
        "LocalSandboxAgentConfig.model_validate({'runtime': {'type': 'local_sandbox'}})\n"
        "assert r._runtime_cls.__name__ == 'resolve'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
