"""Traces of ``local_sandbox`` rollouts are readable by verifiers' own readers: written as
``vf-eval`` writes them, read as ``vf-replay``, ``vf-eval --resume`` and the env-server
client (prime-rl) read them, with no pydantic warning, the full record kept beside."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import verifiers.v1 as vf
from fix_bug_v1 import FixBugHarnessConfig, FixBugTaskset
from pydantic import ValidationError
from verifiers.v1.cli.eval import resume
from verifiers.v1.configs.agent import WireAgentConfig
from verifiers.v1.episode import EnvInfo, Episode, WireEpisode
from verifiers.v1.serve.delta import dump
from verifiers.v1.state import State
from verifiers.v1.task import WireTaskData
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.utils.trace_store import TRACES_FILE, read_episodes, write_episode

from rollout_gateway.v1 import (
    LocalSandboxAgentConfig,
    LocalSandboxRuntimeConfig,
    LocalSandboxRuntimeInfo,
    local_sandbox_record,
    record_for_v1,
)
from rollout_gateway.v1.runtime_record import RECORD_KEY

RUNTIME = LocalSandboxRuntimeConfig(isolation="auto", memory=1.0, pids=64)


def _task() -> Any:
    return next(iter(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1"))))


def _episode(*, provisioned: bool = True) -> tuple[Episode, LocalSandboxAgentConfig, Any]:
    """An episode as a local-sandbox rollout leaves it (the shapes v1's Rollout builds)."""
    task = _task()
    config = LocalSandboxAgentConfig(model="m", harness=FixBugHarnessConfig(), runtime=RUNTIME)
    trace_task = TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
    info = LocalSandboxRuntimeInfo(**RUNTIME.model_dump(), id="local-abc123")
    info.isolation = "bwrap"  # the mode ``auto`` took
    trace = Trace(task=trace_task, agent=AgentInfo(config=config))
    if provisioned:
        trace.agent.runtime = info
    trace.info["task_note"] = "kept"
    episode = Episode(env=EnvInfo(id="rollout-gateway-env"), task=trace_task, traces=[trace])
    episode.ok = True
    return episode, config, task


def test_v1_cannot_read_a_trace_that_names_local_sandbox() -> None:
    """Why the record exists: v1's readers parse the runtime slots with its closed union
    (if this ever passes, v1 learned new runtime types and the record can go)."""
    episode, _, _ = _episode()
    with pytest.raises(ValidationError, match="local_sandbox"):
        WireEpisode.model_validate(dump(episode))


def test_the_record_is_v1s_vocabulary_with_the_full_record_beside(tmp_path: Path) -> None:
    episode, config, _ = _episode()
    (trace,) = episode.traces
    assert record_for_v1(trace) is True
    assert trace.agent.config.runtime == vf.SubprocessConfig()
    assert trace.agent.runtime is not None
    assert trace.agent.runtime.type == "subprocess" and trace.agent.runtime.id == "local-abc123"
    assert trace.info["task_note"] == "kept"
    record = local_sandbox_record(trace)
    assert record is not None
    assert (record.type, record.isolation, record.id) == ("local_sandbox", "bwrap", "local-abc123")
    assert (record.memory, record.pids) == (1.0, 64)
    # The agent's own config, shared by the run's rollouts, still selects the runtime.
    assert config.runtime is RUNTIME
    assert record_for_v1(trace) is False  # once


def test_v1s_readers_accept_the_recorded_trace(tmp_path: Path) -> None:
    episode, _, task = _episode()
    record_for_v1(episode.traces[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pydantic's serialization warnings fail the test
        write_episode(tmp_path, episode)  # as vf-eval appends it
        wire = dump(episode)  # as the env server streams it
    # vf-replay's reader
    (read,) = read_episodes(tmp_path, Trace[WireTaskData, State, WireAgentConfig])
    assert read.traces[0].info[RECORD_KEY]["isolation"] == "bwrap"
    assert local_sandbox_record(read.traces[0]) == local_sandbox_record(episode.traces[0])
    # the env-server client's (prime-rl)
    assert WireEpisode.model_validate(wire).traces[0].agent.runtime.id == "local-abc123"
    # vf-eval --resume keeps the row: nothing owed for the task
    ((_, kept, owed),) = resume.load(tmp_path, [task], 1)
    assert (len(kept), owed) == (1, 0)
    assert (tmp_path / TRACES_FILE).read_text().count("\n") == 1


def test_a_rollout_that_never_got_its_sandbox_is_recorded_from_its_config() -> None:
    episode, _, _ = _episode(provisioned=False)
    (trace,) = episode.traces
    assert record_for_v1(trace) is True
    assert trace.agent.runtime is None
    assert trace.info[RECORD_KEY]["type"] == "local_sandbox"
    assert trace.info[RECORD_KEY]["id"] is None
    WireEpisode.model_validate(dump(episode))


def test_traces_of_other_runtimes_are_left_alone() -> None:
    task = _task()
    trace_task = TraceTask(type=type(task).__name__, data=task.data)
    config = vf.AgentConfig(model="m", runtime=vf.SubprocessConfig())
    trace = Trace(task=trace_task, agent=AgentInfo(config=config))
    before = trace.model_dump(mode="json")
    assert record_for_v1(trace) is False
    assert trace.model_dump(mode="json") == before
    assert local_sandbox_record(trace) is None
