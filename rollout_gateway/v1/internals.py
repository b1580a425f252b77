"""Every part of verifiers v1 the adapter uses, in one module, behind a version check.

The adapter plugs into v1 through names ``verifiers.v1`` does not re-export (its
interception contract, the trace graph, the chat dialect, the harness and session
classes, the agent-config helper), and those move between verifiers releases: prime-rl
pins verifiers by git commit, and at an older commit ``agent_config_fields`` lives in
``verifiers.v1.agent``, not ``verifiers.v1.configs.agent``. So:

- the rest of :mod:`rollout_gateway.v1` imports verifiers only from here;
- importing this module first checks the installed verifiers against
  :data:`SUPPORTED_VERIFIERS` and raises :class:`UnsupportedVerifiersError` (an
  ``ImportError``) naming the installed and the supported versions, before any v1
  import can fail deep inside an env server; an internal that moved under a version
  inside the range fails with the same error, naming what is missing.

Tested releases: see :data:`TESTED_VERIFIERS` (docs/v1.md says the same).
"""

from __future__ import annotations

from importlib import metadata

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


def _version_tuple(version: str) -> tuple[int, int, int, bool]:
    """``(major, minor, micro, is_release)`` of a PEP 440 version (enough for the range)."""
    head = version.split("+", 1)[0]
    parts: list[int] = []
    rest = head
    for _ in range(3):
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        parts.append(int(digits or 0))
        if rest.startswith("."):
            rest = rest[1:]
        if not rest or not rest[0].isdigit():
            break
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2], not rest or rest.startswith("post")


def is_supported(version: str) -> bool:
    """Whether ``version`` is in :data:`SUPPORTED_VERIFIERS` (pre-releases of 0.4.0,
    e.g. ``0.4.0.dev3``, are before 0.4.0 and so not; those of 0.4.1 are)."""
    major, minor, micro, release = _version_tuple(version)
    if (major, minor) != (0, 4):
        return False
    return micro > 0 or release


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
        RolloutError,
        Runtime,
        Sampling,
        TaskError,
        TimeSpan,
        ToolMessage,
        Trace,
        TunnelError,
        TurnTokens,
        Usage,
        graph,
    )

    # Runtimes: the runtime configs (the local_sandbox runtime type joins their union) and
    # the runtime module (whose runtime registry the local_sandbox runtime extends).
    from verifiers.v1 import runtimes as v1_runtimes

    # The internals, below: each moved between versions or may.
    # The agent-config helper (``verifiers.v1.agent`` at older commits).
    from verifiers.v1.configs.agent import agent_config_fields

    # The chat dialect: requests and messages of recorded turns, as v1's server parses them.
    from verifiers.v1.dialects.chat import ChatDialect, parse_message
    from verifiers.v1.envs.single_agent import SingleAgentEnv, SingleAgentEnvConfig

    # The error model's stop names (``<boundary>_error``).
    from verifiers.v1.errors import SandboxError, stop_condition

    # The trace graph: replaying recorded turns as v1's server commits them.
    from verifiers.v1.graph import PendingTurn, prepare_turn

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
    from verifiers.v1.session import RolloutSession
except ImportError as e:  # an internal moved: say which verifiers, not just which name
    raise UnsupportedVerifiersError(VERIFIERS_VERSION, f"{type(e).__name__}: {e}") from e

# What `rollout-gateway demo` runs a v1 eval with, as vf-eval does (rollout_gateway.v1.demo):
# the resolved config and its files, env loading, planning, the trace store.
try:
    from verifiers.v1.cli.eval import resume as eval_resume
    from verifiers.v1.cli.output import create_attempt_log_dir, write_config
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.cli.eval import EvalConfig
    from verifiers.v1.episode import EvalRunInfo
    from verifiers.v1.utils.eval import plan_rollouts
    from verifiers.v1.utils.loaders import load_environment
    from verifiers.v1.utils.trace_store import type_adapter
except ImportError as e:  # an internal moved: say which verifiers, not just which name
    raise UnsupportedVerifiersError(VERIFIERS_VERSION, f"{type(e).__name__}: {e}") from e


def install_runtime_type(config_cls: type, runtime_cls: type[Runtime]) -> None:
    """Make v1's runtime table resolve configs of ``config_cls`` to ``runtime_cls``
    (idempotent; every other config is resolved by v1's own function as before).

    The one change the adapter makes to v1's behaviour, and why it is one: verifiers 0.4
    builds a runtime from its config through one closed table, the private function
    ``verifiers.v1.runtimes._runtime_cls`` (``{"subprocess": SubprocessRuntime, ...}
    [config.type]``), which ``make_runtime`` (every rollout's box), ``provision_runtime``
    and ``runtime_is_local`` (whether an agent's interception needs a tunnel) all call.
    v1 has no registry, entry point or config hook for runtimes (harnesses, tasksets and
    judges are plug-ins; runtimes are not), and no other seam avoids the table: handing
    v1 a ready box (``Agent.run(task, runtime=box)``) still looks the agent's config up
    in it (``runtime_is_local`` when the agent enters without an injected interception),
    marks every trace ``borrowed`` and skips the per-task resource resolution; and a
    rollout calls ``make_runtime`` as a module function, with no method of the agent or
    env in between. So this wraps the table function once; ``rollout_gateway.v1.runtime``
    calls it for ``local_sandbox`` when imported. ``tests/v1/test_runtime.py`` pins it
    (the entry resolves; every v1 type resolves to v1's runtime of that name, as
    before). What v1 *records* of a runtime needs no change to v1:
    :mod:`rollout_gateway.v1.runtime_record`.
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


__all__ = [
    "EvalConfig",
    "EvalRunInfo",
    "ModelContext",
    "create_attempt_log_dir",
    "eval_resume",
    "load_environment",
    "plan_rollouts",
    "type_adapter",
    "write_config",
    "Agent",
    "AgentInfo",
    "ApptainerConfig",
    "BaseRuntimeInfo",
    "DockerConfig",
    "E2BConfig",
    "ModalConfig",
    "PodmanConfig",
    "PrimeConfig",
    "RuntimeProcess",
    "SandboxError",
    "SubprocessConfig",
    "SubprocessRuntimeInfo",
    "install_runtime_type",
    "v1_runtimes",
    "AssistantMessage",
    "BaseInterceptionConfig",
    "ChatDialect",
    "ElasticInterceptionPoolConfig",
    "Env",
    "Error",
    "Harness",
    "Interception",
    "InterceptionError",
    "InterceptionServerConfig",
    "ModelCall",
    "PendingTurn",
    "ProgramResult",
    "ProviderError",
    "Response",
    "RolloutError",
    "RolloutSession",
    "Runtime",
    "Sampling",
    "SingleAgentEnv",
    "SingleAgentEnvConfig",
    "Slot",
    "StaticInterceptionPoolConfig",
    "TaskError",
    "TimeSpan",
    "ToolMessage",
    "Trace",
    "TunnelError",
    "TurnTokens",
    "Usage",
    "agent_config_fields",
    "graph",
    "make_interception",
    "parse_message",
    "prepare_turn",
    "stop_condition",
    "vf",
    "SUPPORTED_VERIFIERS",
    "TESTED_VERIFIERS",
    "VERIFIERS_VERSION",
    "UnsupportedVerifiersError",
    "check_verifiers",
    "is_supported",
]
