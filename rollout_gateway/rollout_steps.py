"""How one rollout's steps run: each at most once, errors typed, finalize steps bounded.

:class:`StepRunner` is the half of :class:`rollout_gateway.lifecycle.GatewayRollout`
that runs a hook as a named step. The rollout's stages raise their step's typed error;
finalize's steps never raise (their failure is recorded, or only logged) and each is
bounded by the settings' ``finalize_step_timeout``, so one hung step cannot keep the
next from releasing what it holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rollout_gateway.errors import RolloutInfraError

logger = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]
"""A step's work: an adapter's :class:`~rollout_gateway.lifecycle.RolloutHooks` method."""


def absorb_cancel() -> None:
    """Inside ``except CancelledError`` of a finalize step: finalize goes on regardless.

    Finalize runs in its own task, shielded from the rollout's cancellation; a cancel
    seen here is the step's own (its hook cancelled its task) or the loop shutting down,
    and stopping would leak what the later steps release (each is still bounded).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()


class StepRunner:
    """Runs one rollout's named steps, each at most once.

    Args:
        rollout_id: for the log lines.
        finalize_step_timeout: the bound of each finalize step, in seconds (None: none).
        is_typed: whether a hook's error is already typed (then kept as raised).
        fail: records a finalize step's failure on the rollout.
    """

    def __init__(
        self,
        rollout_id: str,
        *,
        finalize_step_timeout: float | None,
        is_typed: Callable[[BaseException], bool],
        fail: Callable[[BaseException], None],
    ) -> None:
        self.rollout_id = rollout_id
        self.finalize_step_timeout = finalize_step_timeout
        self.is_typed = is_typed
        self._fail = fail
        self._ran: set[str] = set()

    def ran(self, name: str) -> bool:
        """Whether step ``name`` has run (or is running)."""
        return name in self._ran

    async def run(self, name: str, hook: Hook, error_type: type[Exception]) -> None:
        """Run ``hook`` once; an untyped failure becomes ``error_type``."""
        if name in self._ran:
            return
        self._ran.add(name)
        try:
            await hook()
        except Exception as e:
            typed = self.typed(e, error_type, name)
            if typed is e:
                raise
            raise typed from e

    async def guarded(self, name: str, hook: Hook, error_type: type[Exception]) -> None:
        """A finalize step: bounded; its failure is recorded, never raised."""
        try:
            await self._bounded(name, hook, error_type)
        except asyncio.CancelledError:
            absorb_cancel()
            self._fail(error_type(f"{name} was cancelled"))
        except Exception as e:
            logger.warning("rollout=%s %s failed: %s", self.rollout_id, name, e)
            self._fail(e)

    async def quiet(self, name: str, hook: Hook) -> None:
        """A best-effort finalize step: bounded; its failure is only logged."""
        try:
            await self._bounded(name, hook, RolloutInfraError)
        except asyncio.CancelledError:
            absorb_cancel()
            logger.warning("rollout=%s %s was cancelled", self.rollout_id, name)
        except Exception as e:
            logger.warning("rollout=%s %s failed: %s", self.rollout_id, name, e)

    def typed(self, error: Exception, error_type: type[Exception], stage: str) -> Exception:
        """``error`` if already typed, else an ``error_type`` naming the stage."""
        if self.is_typed(error):
            return error
        return error_type(f"{stage} failed: {type(error).__name__}: {error}")

    async def _bounded(self, name: str, hook: Hook, error_type: type[Exception]) -> None:
        timeout = self.finalize_step_timeout
        deadline = asyncio.timeout(timeout)
        try:
            # In finalize's own task: a task per step costs a loop hop each way, which a
            # loop busy with a 500-rollout burst turns into hundreds of milliseconds.
            async with deadline:
                await self.run(name, hook, error_type)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise error_type(f"{name} did not finish within {timeout:g}s") from None


__all__ = ["Hook", "StepRunner", "absorb_cancel"]
