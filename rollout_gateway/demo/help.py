"""``rollout-gateway demo --help``: the installed stack's description and run directory
layout, and the sandbox isolation this host offers (probed only when help is shown:
probing starts processes)."""

from __future__ import annotations

import argparse
import textwrap

#: Placeholders the formatter replaces when help is shown.
DESCRIPTION = "{description}"
EPILOG = "{epilog}"


def needs_a_stack() -> str:
    """``demo`` on an install without a verifiers stack (the core alone): what to run."""
    from rollout_gateway.verifiers_stack import install_command

    return (
        "the demo runs an example env of verifiers, which this install lacks (core only: "
        "the gateway server and the scripted model). Install a verifiers stack, one per "
        f"virtualenv: {install_command('v1')} (verifiers 0.4) or "
        f"{install_command('classic')} (verifiers 0.3)"
    )


def _fill(text: str, width: int, indent: str = "") -> str:
    """``text`` wrapped to ``width``, never inside a word: a command or a path (say
    ``pip install -e '/tmp/my-checkout[v1]'``) stays whole, to be copied as it is."""
    wrapper = textwrap.TextWrapper(
        width, initial_indent=indent, subsequent_indent=indent,
        break_on_hyphens=False, break_long_words=False,
    )  # fmt: skip
    return wrapper.fill(" ".join(text.split()))


class CommandTextFormatter(argparse.HelpFormatter):
    """Help whose text holds commands and paths: wrapped between words only."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return _fill(text, width, indent)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return _fill(text, width).splitlines()


class DemoHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help of ``demo``, for the installed verifiers stack (see the module docstring)."""

    def _format_text(self, text: str) -> str:
        from rollout_gateway.demo.options import STACK_HELP
        from rollout_gateway.verifiers_stack import installed_stack

        description, layout = STACK_HELP[installed_stack() or "classic"]
        width = max(self._width - self._current_indent, 40)
        if text == DESCRIPTION:
            text = _fill(description, width)
        elif text == EPILOG:
            text = f"{isolation_help()}\n\n{_fill(layout, width)}"
        return super()._format_text(text)


def isolation_help() -> str:
    """Which local sandbox isolation modes this host offers, and the limits each gets."""
    from rollout_gateway.local_sandbox import FALLBACK_ORDER, tools, unavailable_reasons
    from rollout_gateway.local_sandbox.limits import enforcement

    reasons = unavailable_reasons()
    lines = ["local sandbox isolation (strongest first; auto takes the first available):"]
    for mode in FALLBACK_ORDER:
        state = "available" if reasons[mode] is None else reasons[mode]
        program = tools.bwrap()
        if mode.value == "bwrap" and reasons[mode] is None and program is not None:
            state = f"available ({program.source} bwrap)"
        lines.append(f"  {mode:<14}{state}")
    lines.append("  process-group no containment: only with --isolation process-group")
    offered = [m for m in FALLBACK_ORDER if reasons[m] is None]
    uid = offered[0].uses_sandbox_uid if offered else False
    lines.append("limits each sandbox gets on this host (in the mode auto takes):")
    for kind, how in enforcement(uid).items():
        lines.append(f"  {kind:<14}{how}")
    return "\n".join(lines)


__all__ = ["DESCRIPTION", "EPILOG", "DemoHelpFormatter", "isolation_help", "needs_a_stack"]
