"""StepRunner: each step at most once, errors typed, finalize steps bounded and recorded."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollout_gateway.errors import GatewayError, RolloutGatewayError, SandboxError
from rollout_gateway.rollout_steps import StepRunner


def runner(failures: list[BaseException], timeout: float | None = 5.0) -> StepRunner:
    return StepRunner(
        "r-1",
        finalize_step_timeout=timeout,
        is_typed=lambda e: isinstance(e, RolloutGatewayError),
        fail=failures.append,
    )


async def test_a_step_runs_at_most_once_even_after_it_failed() -> None:
    calls = 0

    async def hook() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("boom")

    steps = runner([])
    with pytest.raises(SandboxError, match="launch failed: RuntimeError: boom"):
        await steps.run("launch", hook, SandboxError)
    await steps.run("launch", hook, SandboxError)  # already ran: nothing happens
    assert calls == 1 and steps.ran("launch") and not steps.ran("fetch")


async def test_a_typed_error_is_raised_as_it_is() -> None:
    error = GatewayError("gateway said no")

    async def hook() -> None:
        raise error

    with pytest.raises(GatewayError) as raised:
        await runner([]).run("register", hook, SandboxError)
    assert raised.value is error


async def test_a_guarded_step_records_its_failure_and_never_raises() -> None:
    failures: list[BaseException] = []

    async def hook() -> None:
        raise ValueError("bad")

    await runner(failures).guarded("unregister", hook, GatewayError)
    assert len(failures) == 1 and isinstance(failures[0], GatewayError)


async def test_a_hung_finalize_step_is_cut_at_its_bound_and_the_next_one_runs() -> None:
    failures: list[BaseException] = []
    steps = runner(failures, timeout=0.01)
    ran = []

    async def hung() -> None:
        await asyncio.Event().wait()

    async def next_step() -> None:
        ran.append("delete")

    await steps.guarded("unregister", hung, GatewayError)
    await steps.guarded("delete_sandbox", next_step, SandboxError)
    assert ran == ["delete"]
    assert [str(e) for e in failures] == ["unregister did not finish within 0.01s"]


async def test_a_step_cancelled_from_inside_is_recorded_and_finalize_goes_on() -> None:
    failures: list[BaseException] = []

    async def cancels_itself() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    await runner(failures).guarded("score", cancels_itself, SandboxError)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the cancel was absorbed
    assert [str(e) for e in failures] == ["score was cancelled"]


async def test_a_quiet_step_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[BaseException] = []

    async def hook() -> None:
        raise RuntimeError("sandbox API down")

    with caplog.at_level(logging.WARNING, logger="rollout_gateway.rollout_steps"):
        await runner(failures).quiet("stop_agent", hook)
    assert failures == []
    assert "stop_agent failed" in caplog.text
