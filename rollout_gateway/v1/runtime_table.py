"""The one change this adapter makes to verifiers v1's behaviour: the ``local_sandbox``
entry of v1's runtime table.

Why it is a change to v1's internals and not a plug-in: verifiers 0.4 builds a runtime
from its config through one closed table, the private function
``verifiers.v1.runtimes._runtime_cls`` (``{"subprocess": SubprocessRuntime, ...}
[config.type]``), which ``make_runtime`` (every rollout's box), ``provision_runtime``
and ``runtime_is_local`` (whether an agent's interception needs a tunnel) all call.
v1 has no registry, entry point or config hook for runtimes (its harnesses, tasksets and
judges are plug-ins; its runtimes are not), and no other seam avoids the table:

- handing v1 a ready box (``Agent.run(task, runtime=box)``) still looks the agent's
  config up in the table (``runtime_is_local`` when the agent enters without an
  injected interception), marks every trace ``borrowed`` and skips the per-task
  resource resolution a provisioned box gets;
- the rollout calls ``make_runtime`` as a module function of ``verifiers.v1.rollout``:
  no method of the agent or env sits in between.

So :func:`install_runtime_type` wraps the table function once: configs of type
``local_sandbox`` resolve to :class:`~rollout_gateway.v1.LocalSandboxRuntime`, every
other config is passed to v1's own function unchanged. It runs when
:mod:`rollout_gateway.v1.runtime` is imported (so importing :mod:`rollout_gateway.v1`
is enough). ``tests/v1/test_runtime.py`` pins it: the entry resolves, the other types
resolve as before, and the table still has the name and the types this expects. Where
issue 24's module of v1 internals (``rollout_gateway/v1/internals.py``) exists, this
belongs beside it. What v1 *records* of the runtime is handled without any change to
v1: :mod:`rollout_gateway.v1.runtime_record`.
"""

from __future__ import annotations

from typing import Any

from verifiers.v1 import runtimes as v1_runtimes
from verifiers.v1.runtimes import Runtime

_MARK = "rollout_gateway_local_sandbox"


def install_runtime_type(config_cls: type, runtime_cls: type[Runtime]) -> None:
    """Make v1's runtime table resolve configs of ``config_cls`` to ``runtime_cls``
    (idempotent; every other config is resolved by v1's function as before)."""
    current = v1_runtimes._runtime_cls
    if getattr(current, _MARK, None) is config_cls:
        return

    def resolve(config: Any) -> type[Runtime]:
        if isinstance(config, config_cls):
            return runtime_cls
        return current(config)

    setattr(resolve, _MARK, config_cls)
    v1_runtimes._runtime_cls = resolve


__all__ = ["install_runtime_type"]
