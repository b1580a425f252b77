"""``rollout-gateway demo``'s options: every bad one is a one-line error and exit code 2
with nothing created; help is the installed stack's; which options were typed is kept."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from stacks import STACK

from rollout_gateway.cli import build_parser, main
from rollout_gateway.demo.options import STACK_HELP, number_of_tasks

OTHER_STACK = {"classic": "v1", "v1": "classic"}.get(STACK, "v1")


def demo(argv: list[str]) -> int:
    """``rollout-gateway demo ARGV``'s exit code (argparse's errors exit)."""
    try:
        return main(["demo", *argv])
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--examples", "0"], "--examples: must be at least 1, got 0"),
        (["--examples", "two"], "--examples: not a number: 'two'"),
        (["--examples", "6"], "--examples 6: the example env has 5 tasks"),
        (["--rollouts-per-example", "0"], "--rollouts-per-example: must be at least 1"),
        (["--concurrency", "-3"], "--concurrency: must be at least 1"),
        (["--max-tokens", "0"], "--max-tokens: must be at least 1"),
        (["--timeout", "0"], "--timeout: must be a positive number of seconds"),
        (["--timeout", "nan"], "--timeout: must be a positive number of seconds"),
        (["--timeout", "inf"], "--timeout: must be a positive number of seconds"),
        (["--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature: must be a finite number >= 0"),
        (["--isolation", "chroot"], "--isolation: invalid choice: 'chroot'"),
        (["--stack", "v2"], "--stack: invalid choice: 'v2'"),
        (["--stack", OTHER_STACK], f"--stack {OTHER_STACK} needs verifiers"),
        (
            ["--upstream", "127.0.0.1:8001/v1", "--model", "m"],
            "--upstream 127.0.0.1:8001/v1: not an http(s) URL (did you mean "
            "http://127.0.0.1:8001/v1?)",
        ),
        (["--upstream", "http://host:99999/v1", "--model", "m"], "not a valid base URL"),
        (["--upstream", "http://127.0.0.1:9/v1"], "--upstream needs --model"),
        (["--model", "qwen"], "--model names the --upstream's model; without --upstream"),
        (["--output", "a", "--resume", "b"], "--resume: not allowed with argument --output"),
        (["--keep-failed"], "--keep-failed: only with --resume DIR"),
        (["--resume", "missing"], "--resume missing: no such directory"),
        (["--resume", "."], "--resume .: no metadata.json (not a demo run)"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_every_bad_option_is_one_line_and_exit_2_with_nothing_created(
    argv: list[str],
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert demo(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()  # one line, no usage block, no traceback
    assert line.startswith("rollout-gateway demo: error: ")
    assert says in line
    assert list(tmp_path.iterdir()) == []  # nothing created (no outputs/, no sandbox root)


def test_an_output_that_holds_results_is_refused_with_the_way_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "results.jsonl").write_text("{}\n")
    assert demo(["--output", str(taken)]) == 2
    err = capsys.readouterr().err
    assert f"use --resume {taken} to continue a run, or another --output" in err
    assert [p.name for p in taken.iterdir()] == ["results.jsonl"]


def test_a_resume_with_unreadable_metadata_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "metadata.json").write_text("{not json")
    assert demo(["--resume", str(tmp_path)]) == 2
    assert "cannot read metadata.json" in capsys.readouterr().err
    (tmp_path / "metadata.json").write_text(json.dumps({"stack": OTHER_STACK, "options": {}}))
    assert demo(["--resume", str(tmp_path)]) == 2
    assert f"a run of the {OTHER_STACK} stack" in capsys.readouterr().err


def test_typed_options_are_told_apart_from_defaults() -> None:
    parser = build_parser()
    args = parser.parse_args(["demo", "--examples", "3", "--verbose", "--resume", "r"])
    assert args.explicit == frozenset({"examples", "verbose", "resume"})
    assert args.examples == 3 and args.temperature == 0.7
    assert parser.parse_args(["demo"]).explicit == frozenset()


def test_help_is_the_installed_stacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo(["--help"]) == 0
    text = capsys.readouterr().out
    description, layout = STACK_HELP[STACK if STACK in ("classic", "v1") else None]
    flat = " ".join(text.split())
    assert " ".join(description.split()) in flat and " ".join(layout.split()) in flat
    if STACK == "v1":
        assert "traces.jsonl" in text and "vf-eval @ DIR/configs/resolved/eval.json" in flat
        assert "results.jsonl" not in text
    else:
        assert "results.jsonl" in text and "traces.jsonl" not in text
    assert "process-group" in text and "bwrap" in text
    assert f"the example env has {number_of_tasks()}" in text
    assert "``" not in text


def test_every_option_has_help_and_there_is_a_version(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help text"
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("rollout-gateway ")
    for text in [parser.format_help(), *(sub.format_help() for sub in subparsers.choices.values())]:
        assert "``" not in text  # docstring markup never reaches a user's terminal
