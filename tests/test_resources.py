"""GatewayResources: teardown leaves nothing open, even from another event loop."""

from __future__ import annotations

import asyncio
import gc
import warnings

from core_world import GATEWAY_URL, World


def test_teardown_from_a_new_loop_after_the_rollouts_loop_was_closed():
    """verifiers' atexit teardown runs ``asyncio.run(env._teardown())`` after the loop
    that ran the rollouts is gone; it must stop the tunnels, not raise."""
    world = World()
    loop = asyncio.new_event_loop()

    async def use() -> None:
        lease = await world.resources.tunnels.lease(GATEWAY_URL)  # starts the monitor
        assert lease.url
        watcher = world.resources.exit_watcher(GATEWAY_URL)
        watcher.subscribe("rollout_left_waiting")  # its long-poll task stays pending

    loop.run_until_complete(use())
    loop.close()  # closed without cancelling its tasks, as a crashed script leaves it

    asyncio.run(world.resources.aclose())
    assert world.leaks()["tunnels"] == []
    assert world.resources.closed
    loop = world = None  # the fake gateway's board still references the dead loop's task
    with warnings.catch_warnings():  # the dead loop's coroutines, never resumed
        warnings.simplefilter("ignore")
        gc.collect()


async def test_teardown_in_the_same_loop_cancels_what_is_in_flight():
    world = World()
    rollout, hooks = world.rollout()
    task = asyncio.ensure_future(rollout.execute(hooks))
    await asyncio.sleep(0.05)
    await world.resources.aclose(grace=5)
    assert task.done()
    assert world.leaks() == {"registered": [], "sandboxes": [], "tunnels": []}
