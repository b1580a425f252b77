"""Policy versions: which weights sampled each turn (asynchronous RL trains on stale turns).

The trainer announces a new version after each weight update
(``POST /v1/policy/version``, admin token). Every turn is stamped with the version in
effect when it was sent upstream, and with the version in effect when its answer came
back when the two differ (the turn spanned an update: some of its tokens may come from
each side). An engine that reports its weights' version in its answers (SGLang's
``metadata.weight_version``) has it recorded beside, and stands in for an announced
version while the trainer never announced one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


class StaleVersionError(ValueError):
    """An announced version is older than the one in effect."""


@dataclass
class PolicyClock:
    """The policy version in effect, as announced by the trainer.

    Args:
        wall_clock: Unix-time source of ``updated_at`` (injectable in tests).
    """

    wall_clock: Callable[[], float] = time.time
    version: int | None = None
    updated_at: float | None = None
    #: Announcements so far (a turn compares counts to see an update it spanned).
    epoch: int = 0

    def check(self, version: int) -> None:
        """Raise :class:`StaleVersionError` when ``version`` is older than the one in
        effect (an announcement that must be refused)."""
        if self.version is not None and version < self.version:
            raise StaleVersionError(
                f"policy version {version} is older than the version in effect ({self.version})"
            )

    def announce(self, version: int) -> None:
        """Make ``version`` the one in effect. Announcing the current one again is a no-op.

        Raises :class:`StaleVersionError` for a version older than the current one
        (versions only move forward; a late duplicate of an old announcement must not
        relabel newer turns).
        """
        if self.version is not None and version < self.version:
            raise StaleVersionError(
                f"policy version {version} is older than the version in effect ({self.version})"
            )
        if version == self.version:
            return
        self.version = version
        self.updated_at = self.wall_clock()
        self.epoch += 1

    def adopt(self, version: int, updated_at: float | None) -> None:
        """Make ``version`` the one in effect as the store holds it (announced through
        the store, restored at start, or announced at another gateway)."""
        if version == self.version:
            return
        self.version = version
        self.updated_at = updated_at
        self.epoch += 1

    def stamp(self, engine_version: str | None = None) -> int | None:
        """The version to stamp on a turn: the announced one, else the engine's own
        (when it is an integer), else ``None``."""
        if self.version is not None:
            return self.version
        if engine_version is not None and engine_version.lstrip("-").isdigit():
            return int(engine_version)
        return None


__all__ = ["PolicyClock", "StaleVersionError"]
