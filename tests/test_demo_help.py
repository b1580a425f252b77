"""``rollout-gateway demo --help`` text (rollout_gateway/demo/help.py)."""

from __future__ import annotations

import argparse

import pytest

from rollout_gateway.demo.help import CommandTextFormatter

COMMAND = "pip install -e '/tmp/my-check-out/rollout-gateway[v1]'"


@pytest.mark.parametrize("width", range(30, 121, 7))
def test_a_command_in_the_help_is_never_broken_at_a_hyphen(width: int) -> None:
    """A checkout path with hyphens stays whole at any terminal width, so the install
    command the help gives can be copied as it is (argparse's own wrapping broke
    ``/tmp/ci-final2`` into ``/tmp/ci-`` and ``final2``)."""
    parser = argparse.ArgumentParser(
        prog="rollout-gateway demo",
        description=f"Install a verifiers stack: {COMMAND} (verifiers 0.4).",
        formatter_class=lambda prog: CommandTextFormatter(prog, width=width),
    )
    parser.add_argument("--stack", help=f"or run {COMMAND} first")
    lines = parser.format_help().splitlines()
    words = " ".join(lines).split()
    assert " ".join(words).count(COMMAND) == 2
    assert not any(line.rstrip().endswith("-") for line in lines if "usage" not in line)
