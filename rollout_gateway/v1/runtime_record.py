"""How a rollout on the ``local_sandbox`` runtime is recorded on its v1 trace, so that
verifiers' own readers accept the trace.

A v1 trace records its runtime twice, in slots typed with v1's closed unions:
``trace.agent.config.runtime`` (a ``RuntimeConfig``: ``subprocess | docker | podman |
apptainer | prime | modal | e2b``) and ``trace.agent.runtime`` (the matching
``RuntimeInfo``). Every reader of traces in verifiers 0.4 parses those slots strictly:
``vf-replay`` (``Trace[WireTaskData, ..., WireAgentConfig]``), ``vf-eval --resume``
(``WireEpisode``: a row that does not parse is silently re-run) and the env-server
client prime-rl trains through (``WireEpisode`` again). None of them can be taught a
new type (pydantic builds their schemas when verifiers is imported; there is no
registry), so a trace saying ``"type": "local_sandbox"`` there is unreadable to all of
them, and pydantic warns when it dumps one.

So a finished local-sandbox rollout is recorded in v1's vocabulary, and the full
record is kept beside it (:func:`record_for_v1`, which the gateway env applies to
every trace of every episode before v1 writes or sends it):

- ``agent.config.runtime``: ``{"type": "subprocess"}``. In v1's taxonomy a local
  sandbox *is* a subprocess runtime: host programs, host network, no image, local
  URLs; the containment is what v1 has no word for. (Rebuilding an agent from the
  trace's config therefore gets v1's uncontained subprocess runtime: rebuild from the
  run's saved config, ``configs/resolved/eval.json``, which keeps ``local_sandbox``.)
- ``agent.runtime``: ``{"type": "subprocess", "id": <sandbox id>, "borrowed": ...}``.
- ``info["local_sandbox"]``: the whole :class:`LocalSandboxRuntimeInfo` (isolation
  mode actually used, limits, root, sandbox id); :func:`local_sandbox_record` reads it
  back. ``trace.info`` is a free-form dict every v1 reader keeps as is.

The run's configuration is not touched: the saved ``eval.json`` keeps
``runtime.type = "local_sandbox"`` (``vf-eval --resume`` validates it with the env's own
config class, which accepts it), so a resumed run runs contained again.
"""

from __future__ import annotations

from typing import Any

from rollout_gateway.v1.config import LocalSandboxRuntimeConfig, LocalSandboxRuntimeInfo
from rollout_gateway.v1.internals import AgentInfo, SubprocessConfig, SubprocessRuntimeInfo, Trace

#: The key of ``trace.info`` holding the local sandbox's full record.
RECORD_KEY = "local_sandbox"


def record_for_v1(trace: Trace[Any, Any, Any]) -> bool:
    """Record ``trace``'s local sandbox in v1's vocabulary (see the module docstring), in
    place; whether it changed anything (traces of other runtimes are left alone, and a
    trace already recorded so is not changed again)."""
    agent = trace.agent
    config_runtime = agent.config.runtime
    info = agent.runtime
    ours = isinstance(config_runtime, LocalSandboxRuntimeConfig) or isinstance(
        info, LocalSandboxRuntimeInfo
    )
    if not ours:
        return False
    if isinstance(info, LocalSandboxRuntimeInfo):
        record = info
    else:  # not provisioned (a setup failure): the configuration is all there is
        assert isinstance(config_runtime, LocalSandboxRuntimeConfig)
        record = LocalSandboxRuntimeInfo(**config_runtime.model_dump())
    trace.info[RECORD_KEY] = record.model_dump(mode="json")
    # A new AgentInfo and config copy: the agent's own config (shared by every rollout
    # of the run) keeps its local_sandbox runtime.
    trace.agent = AgentInfo(
        config=agent.config.model_copy(update={"runtime": SubprocessConfig()}),
        runtime=(
            None if info is None else SubprocessRuntimeInfo(id=record.id, borrowed=record.borrowed)
        ),
        name=agent.name,
        trainable=agent.trainable,
    )
    return True


def local_sandbox_record(trace: Trace[Any, Any, Any]) -> LocalSandboxRuntimeInfo | None:
    """The local sandbox ``trace``'s rollout ran in, as :func:`record_for_v1` kept it (or
    as the live trace holds it); ``None`` for a rollout on another runtime."""
    if isinstance(trace.agent.runtime, LocalSandboxRuntimeInfo):
        return trace.agent.runtime
    record = trace.info.get(RECORD_KEY)
    if not isinstance(record, dict):
        return None
    return LocalSandboxRuntimeInfo.model_validate(record)


__all__ = ["RECORD_KEY", "local_sandbox_record", "record_for_v1"]
