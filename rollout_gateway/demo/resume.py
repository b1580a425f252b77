"""``--resume DIR``: the settings a continued run takes from the run it continues.

A resumed run is the same experiment: every setting in ``DIR/metadata.json`` is reused.
A setting that decides what the rollouts are (:data:`~.options.RESULT_SETTINGS`) typed
again with another value is refused, naming each one; the settings of how one
invocation runs (``--concurrency``, ``--timeout``) may be typed to change this
invocation only (the resume entry in ``metadata.json`` records them). Isolation is
reused as the mode the run ran under, so a resumed run is contained as the run was.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rollout_gateway.demo.options import (
    RESULT_SETTINGS,
    RUN_SETTINGS,
    DemoError,
    DemoOptions,
    number_of_tasks,
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    return "(none)" if value is None else str(value)


def resumed_options(options: DemoOptions, meta: dict[str, Any], stack: str) -> DemoOptions:
    """``options`` with the settings of the run in ``options.resume`` (its ``meta``)."""
    where = options.resume
    assert where is not None
    recorded_stack = meta.get("stack", "classic")  # runs written before the v1 demo existed
    if recorded_stack != stack:
        raise DemoError(
            f"--resume {where}: a run of the {recorded_stack} stack, and this environment "
            f"has the {stack} stack (resume it where it ran: rollout-gateway[{recorded_stack}])"
        )
    previous = meta.get("options")
    if not isinstance(previous, dict):
        raise DemoError(f"--resume {where}: metadata.json records no settings")
    ran_under = meta.get("isolation")
    conflicts = []
    for name in RESULT_SETTINGS:
        if name not in options.explicit or name not in previous:
            continue
        typed, was = getattr(options, name), previous[name]
        if typed != was and not (name == "isolation" and typed == ran_under):
            conflicts.append(f"{_flag(name)} {_shown(was)} (typed: {_shown(typed)})")
    if conflicts:
        raise DemoError(
            f"--resume {where}: the run was started with {'; '.join(conflicts)}. A resumed "
            "run keeps its settings: leave these options out, or start a new run (--output)"
        )
    values = {name: previous[name] for name in RESULT_SETTINGS if name in previous}
    if isinstance(ran_under, str) and ran_under:
        values["isolation"] = ran_under
    values.update(
        {n: previous[n] for n in RUN_SETTINGS if n in previous and n not in options.explicit}
    )
    resumed = dataclasses.replace(options, **values)
    if resumed.examples > number_of_tasks():
        raise DemoError(f"--resume {where}: its --examples {resumed.examples} exceeds the tasks")
    return resumed


def resume_entry(options: DemoOptions, started_at: str, to_run: int) -> dict[str, Any]:
    """What ``metadata.json`` records of one resume."""
    return {
        "started_at": started_at,
        "to_run": to_run,
        "keep_failed": options.keep_failed,
        "changed": {n: getattr(options, n) for n in RUN_SETTINGS if n in options.explicit},
    }


def resume_command(path: Path) -> str:
    """The command that continues the run in ``path``."""
    return f"rollout-gateway demo --resume {path}"


__all__ = ["resume_command", "resume_entry", "resumed_options"]
