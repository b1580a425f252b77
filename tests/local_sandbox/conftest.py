"""Fixtures for the local sandbox backend tests: one client per isolation mode this host
offers (unavailable modes are skipped with the reason), a private root, a fake clock."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollout_gateway.local_sandbox import IsolationMode, LocalSandboxClient, unavailable_reasons

ALL_MODES = list(IsolationMode)
CONTAINED_MODES = [m for m in IsolationMode if m is not IsolationMode.PROCESS_GROUP]


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def require_mode(mode: IsolationMode) -> IsolationMode:
    """Skip the test when this host does not offer ``mode`` (the reason is shown)."""
    reason = unavailable_reasons()[mode]
    if reason is not None:
        pytest.skip(f"isolation {mode} unavailable here: {reason}")
    return mode


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def root() -> Iterator[Path]:
    """A root every sandbox uid can traverse (pytest's tmp_path may sit under a 0700 dir)."""
    path = Path(tempfile.mkdtemp(prefix="rg-sandboxes-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path / "sandboxes"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=ALL_MODES, ids=str)
def mode(request: pytest.FixtureRequest) -> IsolationMode:
    return require_mode(request.param)


def make_client(root: Path, mode: IsolationMode, **kwargs: object) -> LocalSandboxClient:
    options: dict[str, object] = {
        "reap_interval": None,  # expiry is driven by the fake clock in tests
        "kill_grace": 0.5,
        "sweep_stale": False,
        "register_atexit": False,
    }
    options.update(kwargs)
    return LocalSandboxClient(root, isolation=mode, **options)  # type: ignore[arg-type]


@pytest.fixture
async def client(
    root: Path, clock: FakeClock, mode: IsolationMode
) -> AsyncIterator[LocalSandboxClient]:
    c = make_client(root, mode, clock=clock)
    yield c
    c.teardown()
