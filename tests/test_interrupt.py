"""Interrupt: a future ends an await early, without a helper task; outside cancels still win."""

from __future__ import annotations

import asyncio

import pytest

from rollout_gateway.interrupt import Interrupt


async def test_a_resolving_future_ends_the_block_without_error():
    signal: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, signal.set_result, 7)
    tasks_before = len(asyncio.all_tasks())
    async with Interrupt(signal) as it:
        assert len(asyncio.all_tasks()) == tasks_before  # no helper task
        await asyncio.sleep(30)
        pytest.fail("the block should have ended")
    assert it.fired
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)  # and the task is usable afterwards


async def test_the_block_finishing_first_is_not_interrupted_later():
    signal: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    async with Interrupt(signal) as it:
        await asyncio.sleep(0)
    signal.set_result(None)
    await asyncio.sleep(0.01)  # a late callback must not cancel us
    assert not it.fired


async def test_a_future_already_resolved_ends_the_block_at_its_first_await():
    signal: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    signal.set_result(None)
    async with Interrupt(signal) as it:
        await asyncio.sleep(30)
    assert it.fired


async def test_none_never_fires():
    async with Interrupt(None) as it:
        await asyncio.sleep(0)
    assert not it.fired


async def test_an_outside_cancel_propagates_even_when_the_future_fired_too():
    signal: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    entered = asyncio.Event()

    async def waiter() -> None:
        async with Interrupt(signal):
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.ensure_future(waiter())
    await entered.wait()
    task.cancel()
    signal.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outside_cancel_without_the_future_propagates():
    signal: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waiter() -> None:
        async with Interrupt(signal):
            await asyncio.sleep(30)

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not signal.done()


async def test_an_error_in_the_block_propagates():
    signal: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(ValueError):
        async with Interrupt(signal):
            raise ValueError("boom")
    signal.set_result(None)
    await asyncio.sleep(0)
