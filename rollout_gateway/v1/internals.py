"""Every part of verifiers v1 the adapter's runtime uses, in one module, behind a version check.

The adapter plugs into v1 through names ``verifiers.v1`` does not re-export (its
interception contract, the trace graph, the chat dialect, the session, the runtime
configs, the agent-config helper), and through a few private ones (:data:`PRIVATE`).
Those move between verifiers releases: prime-rl pins verifiers by git commit, and at an
older commit ``agent_config_fields`` lives in ``verifiers.v1.agent``. So:

- the rest of :mod:`rollout_gateway.v1` imports verifiers only from here (what only the
  demo's eval runner needs, v1's CLI, from :mod:`.eval_internals`: a moved CLI module
  does not break the runtime adapter);
- importing this module first checks the installed verifiers against
  :data:`SUPPORTED_VERIFIERS` and raises :class:`UnsupportedVerifiersError` (an
  ``ImportError``) naming the installed and the supported versions, before any v1
  import can fail deep inside an env server; an internal that moved under a version
  inside the range fails with the same error, naming what is missing;
- :data:`PRIVATE` lists every private name and behaviour of v1 the adapter depends on;
  ``tests/v1/test_private_dependencies.py`` holds one contract test for each, which fails
  naming the entry when verifiers changes it.

Nothing here changes v1 at import: the one change to v1's behaviour
(:func:`install_runtime_type`) is made by an explicit step, :func:`rollout_gateway.v1.install`.

Tested releases: see :data:`TESTED_VERIFIERS` (docs/v1.md says the same).
"""

# ruff: noqa: F401 (this module hands verifiers' names on to the rest of the adapter)
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: verifiers versions the adapter accepts (PEP 440 specifier, checked at import).
SUPPORTED_VERIFIERS = ">=0.4.0,<0.5"
#: The versions the whole test suite passes with: the one 0.4 release on PyPI, which the
#: ``[v1]`` extra pins. (docs/v1.md says what else was run: the newest 0.4.1 pre-release.)
TESTED_VERIFIERS = ("0.4.0",)


class UnsupportedVerifiersError(ImportError):
    """The installed verifiers is not one the v1 adapter supports."""

    def __init__(self, installed: str | None, detail: str = "") -> None:
        self.installed = installed
        what = f"verifiers {installed}" if installed else "no verifiers"
        message = (
            f"rollout_gateway.v1 needs verifiers {SUPPORTED_VERIFIERS} (tested: "
            f"{', '.join(TESTED_VERIFIERS)}); {what} is installed"
        )
        if detail:
            message += f": {detail}"
        message += ". Install rollout-gateway[v1], or the verifiers your trainer pins if it "
        message += "is in that range."
        super().__init__(message)


def is_supported(version: str) -> bool:
    """Whether ``version`` is in :data:`SUPPORTED_VERIFIERS`. Pre-releases count (prime-rl
    pins verifiers by commit, whose builds are ``.devN`` versions): those of 0.4.1 are in
    the range, those of 0.4.0 (``0.4.0.dev3``) come before 0.4.0 and are not."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED_VERIFIERS).contains(parsed, prereleases=True)


def check_verifiers(version: str | None = None) -> str:
    """The installed verifiers version; raises :class:`UnsupportedVerifiersError` unless
    it is supported (``version`` stands in for the installed one, for tests)."""
    if version is None:
        try:
            version = metadata.version("verifiers")
        except metadata.PackageNotFoundError:
            raise UnsupportedVerifiersError(None) from None
    if not is_supported(version):
        raise UnsupportedVerifiersError(version)
    return version


VERIFIERS_VERSION = check_verifiers()


try:
    import verifiers.v1 as vf

    # Public names of verifiers.v1 (re-exported by the package in every tested version).
    from verifiers.v1 import (
        Agent,
        AgentInfo,
        AssistantMessage,
        Env,
        Error,
        Harness,
        InterceptionError,
        ModelCall,
        ProgramResult,
        ProviderError,
        Response,
        Runtime,
        Sampling,
        TaskError,
        TimeSpan,
        ToolMessage,
        Trace,
        TunnelError,
        TurnTokens,
        Usage,
    )

    # Runtimes: the runtime configs (the local_sandbox runtime type joins their union) and
    # the runtime module (whose runtime table install_runtime_type extends).
    from verifiers.v1 import runtimes as v1_runtimes

    # ACP harnesses (claude_code, codex, pi): their live session, which acp_sync extends.
    from verifiers.v1.acp import ACPHarness, ACPHarnessSession

    # The internals, below: each moved between versions or may.
    # The agent-config helper (``verifiers.v1.agent`` at older commits).
    from verifiers.v1.configs.agent import agent_config_fields

    # The dialects: each one's provider path (``upstream_path``, a call's ``endpoint``).
    from verifiers.v1.dialects.anthropic import AnthropicDialect

    # The chat dialect: requests and messages of recorded turns, as v1's server parses them.
    from verifiers.v1.dialects.chat import ChatDialect, parse_message
    from verifiers.v1.dialects.responses import ResponsesDialect
    from verifiers.v1.envs.single_agent import SingleAgentEnv, SingleAgentEnvConfig
    from verifiers.v1.errors import SandboxError

    # The trace graph: replaying recorded turns as v1's server commits them.
    from verifiers.v1.graph import PendingTurn, prepare_turn

    # The Node harnesses' Node.js install (where ensure_node looks, the version it wants).
    from verifiers.v1.harnesses import node as v1_node

    # The interception contract, and v1's own interception types.
    from verifiers.v1.interception import (
        BaseInterceptionConfig,
        ElasticInterceptionPoolConfig,
        Interception,
        InterceptionServerConfig,
        Slot,
        StaticInterceptionPoolConfig,
        make_interception,
    )
    from verifiers.v1.runtimes import (
        ApptainerConfig,
        BaseRuntimeInfo,
        DockerConfig,
        E2BConfig,
        ModalConfig,
        PodmanConfig,
        PrimeConfig,
        RuntimeProcess,
        SubprocessConfig,
        SubprocessRuntimeInfo,
    )
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime
    from verifiers.v1.session import RolloutSession
    from verifiers.v1.utils.loaders import load_harness
except ImportError as e:  # an internal moved: say which verifiers, not just which name
    raise UnsupportedVerifiersError(VERIFIERS_VERSION, f"{type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class PrivateDependency:
    """One private name or behaviour of verifiers v1 the adapter relies on: ``kind`` is
    ``patch`` (replaced, by :func:`rollout_gateway.v1.install`), ``override`` (a subclass
    overrides it), ``mirror`` (the adapter's code follows v1's, which it cannot call),
    ``attribute`` (read or set) or ``behaviour`` (what v1 does that the design counts on);
    ``used_by`` is the adapter's module; ``scope`` ``eval`` is the demo's eval runner only
    (:mod:`.eval_internals`). docs/v1.md says why each is needed."""

    name: str
    kind: Literal["patch", "override", "mirror", "attribute", "behaviour"]
    used_by: str
    scope: Literal["runtime", "eval"] = "runtime"


_P = PrivateDependency
#: Every private dependency on verifiers v1 (docs/v1.md's table; each entry has a contract
#: test in tests/v1/test_private_dependencies.py, under the entry's name).
PRIVATE: tuple[PrivateDependency, ...] = (
    _P("verifiers.v1.runtimes._runtime_cls", "patch", "runtime"),
    _P("verifiers.v1.env.Env._episode_agents", "override", "env"),
    _P("verifiers.v1.env.Env.serving", "mirror", "env"),
    _P("verifiers.v1.env.Env._interception", "attribute", "env"),
    _P("verifiers.v1.env.Env._shared_tools", "attribute", "env"),
    _P("verifiers.v1.env.Env._requires_tunnel", "attribute", "env"),
    _P("verifiers.v1.harness.HarnessSession.turn", "behaviour", "harness_sync"),
    _P("verifiers.v1.agent.Agent._rollout_params", "behaviour", "harness_sync"),
    _P("verifiers.v1.agent.Agent._check_resume_support", "behaviour", "harness_sync"),
    _P("verifiers.v1.graph.PendingTurn", "attribute", "trace_sync"),
    _P("verifiers.v1.types.TurnTokens.message_spans", "attribute", "trace_sync"),
    _P("verifiers.v1.session.RolloutSession", "attribute", "interception"),
    _P("verifiers.v1.acp.ACPHarnessSession._request", "override", "acp_sync"),
    _P("verifiers.v1.cli", "attribute", "eval_internals", scope="eval"),
)


def install_runtime_type(config_cls: type, runtime_cls: type[Runtime]) -> None:
    """Make v1's runtime table resolve configs of ``config_cls`` to ``runtime_cls``
    (idempotent; every other config is resolved by v1's own function as before).

    The one change the adapter makes to v1 (:data:`PRIVATE`'s ``patch``), made by
    :func:`rollout_gateway.v1.install`, never at import. Why no other seam serves: v1
    builds every runtime through this closed table (``make_runtime``, ``provision_runtime``,
    ``runtime_is_local``) and has no registry, entry point or config hook for runtimes;
    handing v1 a ready box (``Agent.run(task, runtime=box)``) still looks the config up in
    it, marks every trace ``borrowed`` and skips the per-task resources; and a rollout
    calls ``make_runtime`` as a module function, with no method of the agent or env in
    between. (What v1 *records* of a runtime needs no change: :mod:`.runtime_record`.)
    """
    current = v1_runtimes._runtime_cls
    if getattr(current, "rollout_gateway_runtime_type", None) is config_cls:
        return

    def resolve(config: object) -> type[Runtime]:
        if isinstance(config, config_cls):
            return runtime_cls
        return current(config)

    resolve.rollout_gateway_runtime_type = config_cls  # type: ignore[attr-defined]
    v1_runtimes._runtime_cls = resolve


def node_harness_modules() -> tuple[Any, Any, Any]:
    """v1's ``claude_code``, ``codex`` and ``pi`` harness modules (their install
    directories and config classes), imported when asked for."""
    from verifiers.v1.harnesses.claude_code import harness as claude_code
    from verifiers.v1.harnesses.codex import harness as codex
    from verifiers.v1.harnesses.pi import harness as pi

    return claude_code, codex, pi
