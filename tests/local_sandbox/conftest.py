"""Fixtures for the local sandbox backend tests: a private root and an injectable clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout_gateway.local_sandbox import LocalSandboxClient


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "sandboxes"


@pytest.fixture
async def client(root: Path, clock: FakeClock) -> AsyncIterator[LocalSandboxClient]:
    c = LocalSandboxClient(
        root,
        clock=clock,
        reap_interval=None,  # expiry is driven by the fake clock in tests
        kill_grace=0.5,
        sweep_stale=False,
        register_atexit=False,
    )
    yield c
    c.teardown()
