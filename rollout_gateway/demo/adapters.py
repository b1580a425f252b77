"""Which adapter runs the demo: each verifiers stack's, resolved by name.

An adapter lives beside its stack (``rollout_gateway.classic.demo``,
``rollout_gateway.v1.demo``) and implements :class:`~.stack.DemoStack`; :data:`ADAPTERS`
names each, so nothing under ``demo/`` imports a stack (no import circle: an adapter
imports the interface, never the reverse).
"""

from __future__ import annotations

import importlib

from rollout_gateway.demo.options import STACKS, DemoError
from rollout_gateway.demo.stack import DemoStack
from rollout_gateway.verifiers_stack import install_command, installed_stack, verifiers_version

#: Each stack's adapter, as ``module:class``.
ADAPTERS = {
    "classic": "rollout_gateway.classic.demo:ClassicStack",
    "v1": "rollout_gateway.v1.demo:V1Stack",
}


def check_stack(requested: str = "auto") -> str:
    """The installed stack's name; ``DemoError`` when ``requested`` names the other one
    or no verifiers is installed (reads package metadata only: imports nothing)."""
    installed = installed_stack()
    if installed is None:
        raise DemoError(
            f"no verifiers stack is installed: {install_command('v1')} (verifiers 0.4) or "
            f"{install_command('classic')} (verifiers 0.3), one per virtualenv"
        )
    if requested not in ("auto", installed):
        other = {"classic": "verifiers 0.3", "v1": "verifiers 0.4"}[requested]
        raise DemoError(
            f"--stack {requested} needs {other}; this environment has verifiers "
            f"{verifiers_version()}, the {installed} stack (the two extras exclude each "
            f"other: in another virtualenv, {install_command(requested)}; or --stack "
            f"{installed})"
        )
    return installed


def load_stack(name: str) -> DemoStack:
    """A new adapter of stack ``name`` (imports its module: seconds for v1, whose
    package imports verifiers; call it off the event loop)."""
    stack = stack_class(name)()
    stack.verifiers_version = verifiers_version() or ""
    return stack


def stack_class(name: str) -> type[DemoStack]:
    """The adapter class of stack ``name``."""
    if name not in ADAPTERS:
        raise ValueError(f"unknown stack {name!r} (known: {', '.join(STACKS)})")
    module, _, attribute = ADAPTERS[name].partition(":")
    adapter = getattr(importlib.import_module(module), attribute)
    if not (isinstance(adapter, type) and issubclass(adapter, DemoStack)):
        raise TypeError(f"{ADAPTERS[name]} is not a DemoStack")
    return adapter


__all__ = ["ADAPTERS", "check_stack", "load_stack", "stack_class"]
