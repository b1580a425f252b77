"""The Python the harness cache builds scripts' environments on
(:mod:`rollout_gateway.v1.harness_python`, the runtime's ``harness_python``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollout_gateway.v1 import LocalSandboxRuntimeConfig
from rollout_gateway.v1.harness_python import (
    HARNESS_PYTHON_ENV_VAR,
    find_python,
    python_prefix,
)
from rollout_gateway.v1.runtime import LocalSandboxStartError, check_local_sandbox


def test_find_python_finds_one_of_the_version_asked_for_or_none() -> None:
    here = sys.version_info[:2]
    assert find_python(here) is not None  # the running one's python3.X is on PATH here
    found = find_python((3, 12))
    if found is not None:
        assert python_prefix(found).is_dir()
    assert find_python((3, 99)) is None


def test_find_python_looks_in_pyenvs_versions_off_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pyenv root whose only version is this interpreter's installation, PATH empty.
    version = tmp_path / "versions" / "9.1.0" / "bin"
    version.mkdir(parents=True)
    (version / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert find_python(sys.version_info[:2]) == str(version / "python3")
    assert find_python((3, 99)) is None


def test_python_prefix_is_the_interpreters_installation() -> None:
    assert python_prefix(sys.executable) == Path(sys.base_prefix).resolve()
    with pytest.raises(ValueError, match="not a Python interpreter that runs"):
        python_prefix("/nonexistent/python3")


def test_the_runtime_takes_harness_python_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(HARNESS_PYTHON_ENV_VAR, "/opt/python3.12/bin/python3")
    assert LocalSandboxRuntimeConfig().harness_python == "/opt/python3.12/bin/python3"
    monkeypatch.delenv(HARNESS_PYTHON_ENV_VAR)
    assert LocalSandboxRuntimeConfig().harness_python is None


async def test_a_harness_python_that_does_not_run_fails_before_any_rollout(
    tmp_path: Path,
) -> None:
    config = LocalSandboxRuntimeConfig(
        isolation="process-group",
        root=str(tmp_path / "sandboxes"),
        harness_cache_root=str(tmp_path / "cache"),
        harness_python=str(tmp_path / "missing" / "python3"),
    )
    with pytest.raises(LocalSandboxStartError, match="harness_python"):
        await check_local_sandbox(config)
