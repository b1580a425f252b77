"""End a harness segment the moment the gateway refuses one of its rollout's turns.

v1's own interception refuses a turn past a limit with a 400 and sets the stop; the
harness is expected to exit on it. Real agents do not always: some retry any 4xx (an
agent framework that maps the status to a generic API error retries it with backoff for
minutes). In gateway mode the gateway reports every refusal on its exit channel
(:mod:`rollout_gateway.exits`); :class:`RefusalWatch` follows it for one rollout while a
harness segment runs and, on a refusal, cancels the segment's await of the harness
program, which is how v1 itself ends a harness program that outlives its time (the
runtime kills the program when its ``run`` is cancelled; the subprocess runtime kills its
process group). The segment then returns a :data:`REFUSED_EXIT_CODE` result, and the
sync hook sets the limit as the trace's stop before v1 judges that exit.

No helper task: the watch resubscribes from the report's callback, and the cancellation
is :class:`rollout_gateway.interrupt.Interrupt`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rollout_gateway.interrupt import Interrupt
from rollout_gateway.protocol import ExitReport
from rollout_gateway.v1.internals import ProgramResult

if TYPE_CHECKING:
    from rollout_gateway.exits import ExitWatcher

#: Exit code of a harness segment the gateway's refusal ended (as a shell reports a
#: program killed by SIGKILL).
REFUSED_EXIT_CODE = 137


class RefusalWatch:
    """``async with watch:`` around a harness segment; the block ends (normally) when the
    gateway reports refusing a turn of the rollout, and ``watch.fired`` says so.

    Args:
        watcher: the exit-channel watcher of the rollout's gateway (``None``: never fires).
        rollout_id: the rollout.
        on_refusal: called with the refusal's code when it comes.
    """

    def __init__(
        self,
        watcher: ExitWatcher | None,
        rollout_id: str | None,
        *,
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        self.watcher = watcher
        self.rollout_id = rollout_id
        self.on_refusal = on_refusal
        #: The refusal's code, once the gateway reported one.
        self.code: str | None = None
        self._refused: asyncio.Future[str] | None = None
        self._interrupt = Interrupt(None)
        self._watching = False

    @property
    def fired(self) -> bool:
        """Whether a refusal ended the block."""
        return self._interrupt.fired

    async def __aenter__(self) -> RefusalWatch:
        if self.watcher is not None and self.rollout_id is not None:
            self._refused = asyncio.get_running_loop().create_future()
            self._interrupt = Interrupt(self._refused)
            self._watching = True
            self._subscribe()
        await self._interrupt.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._watching = False
        if self.watcher is not None and self.rollout_id is not None:
            self.watcher.unsubscribe(self.rollout_id)
        return await self._interrupt.__aexit__(exc_type, exc, tb)

    def result(self) -> Any:
        """The result of a segment a refusal ended: what a killed program returns."""
        return ProgramResult(
            exit_code=REFUSED_EXIT_CODE,
            stdout="",
            stderr=f"rollout-gateway: the agent was stopped: the gateway refused its turn "
            f"({self.code})",
        )

    def _subscribe(self) -> None:
        assert self.watcher is not None and self.rollout_id is not None
        self.watcher.subscribe_report(self.rollout_id).add_done_callback(self._on_report)

    def _on_report(self, future: asyncio.Future[ExitReport]) -> None:
        if future.cancelled() or not self._watching:
            return
        report = future.result()
        code = report.get("refused")
        if code is None:
            self._subscribe()  # another report (an agent's own): keep watching
            return
        self.code = code
        if self.on_refusal is not None:
            self.on_refusal(code)
        if self._refused is not None and not self._refused.done():
            self._refused.set_result(code)


__all__ = ["REFUSED_EXIT_CODE", "RefusalWatch"]
