"""What ``rollout-gateway demo`` runs: its options, their command-line form and checks.

Every check here runs before anything is created: a bad option is one line
(``rollout-gateway demo: error: ...``) and exit code 2. Which options the user typed is
kept (:attr:`DemoOptions.explicit`): ``--resume`` reuses the run's settings and refuses
a typed one that differs (:mod:`.resume`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

#: Where results go when neither ``--output`` nor ``--resume`` is given.
DEFAULT_OUTPUT_ROOT = Path("outputs")
#: The verifiers stacks the demo runs on (``auto``: the installed one).
STACKS = ("classic", "v1")
ISOLATION_CHOICES = ("auto", "bwrap", "unshare", "uid", "process-group")


class DemoError(RuntimeError):
    """Something the user can fix stops the demo; the message says what and how."""


@dataclass(frozen=True)
class DemoOptions:
    """What ``rollout-gateway demo`` runs."""

    examples: int = 3
    rollouts_per_example: int = 3
    concurrency: int = 9
    output: Path | None = None
    resume: Path | None = None
    upstream: str | None = None
    model: str | None = None
    temperature: float = 0.7
    max_tokens: int = 512
    timeout: float = 300.0
    isolation: str = "auto"
    stack: str = "auto"
    keep_failed: bool = False
    verbose: bool = False
    #: The options the user gave on the command line (their field names).
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    def recorded(self) -> dict[str, Any]:
        """The settings stored in ``metadata.json`` (what ``--resume`` reuses)."""
        return {name: getattr(self, name) for name in (*RESULT_SETTINGS, *RUN_SETTINGS)}


#: Settings that decide what a run's rollouts are: a resumed run keeps them, and refuses a
#: typed value that differs (the results would mix two experiments).
RESULT_SETTINGS = (
    "examples",
    "rollouts_per_example",
    "upstream",
    "model",
    "temperature",
    "max_tokens",
    "isolation",
)
#: Settings of how one invocation runs: a resumed run reuses them unless typed again.
RUN_SETTINGS = ("concurrency", "timeout")


#: ``demo --help`` on each stack: (description, the run directory's layout).
STACK_HELP = {
    "classic": (
        "Start the scripted model (or use --upstream) and the reference gateway on loopback, "
        "run the example env (rollout_gateway.examples.fix_bug_env, verifiers 0.3) in "
        "gateway mode on contained local sandboxes, show progress, and write each rollout "
        "to DIR/results.jsonl as it finishes. Ctrl-C or SIGTERM stops cleanly (finished "
        "results kept, sandboxes removed); --resume DIR continues.",
        "results (what vf-eval 0.3 writes): DIR/results.jsonl, one rollout per line as each "
        "finishes, and DIR/metadata.json with vf-eval's keys (avg_reward, num_examples, "
        "sampling_args, version_info, ...) plus the demo's (settings, status, counts, "
        "resumes).",
    ),
    "v1": (
        "Start the scripted model (or use --upstream) and the reference gateway on loopback, "
        "run the example taskset (rollout-gateway-fix-bug-v1, verifiers v1) in gateway mode "
        "through v1's own env machinery, show progress, and write each episode to "
        "DIR/traces.jsonl as it finishes. Ctrl-C or SIGTERM stops cleanly (finished "
        "episodes kept, agents stopped); --resume DIR continues.",
        "results (a verifiers v1 run directory): DIR/configs/resolved/eval.json (the "
        "resolved config), DIR/traces.jsonl (one episode per line as each finishes, "
        "full-precision floats), DIR/logs/latest/eval.log, and DIR/metadata.json (the "
        "demo's settings, status, counts, resumes). vf-replay DIR re-scores it; vf-eval @ "
        "DIR/configs/resolved/eval.json --resume continues it against a gateway at the "
        "address it names.",
    ),
}


def number_of_tasks() -> int:
    """Tasks of the example env (the same tasks on both stacks)."""
    from rollout_gateway.examples.fix_bug_env.tasks import TASKS

    return len(TASKS)


class DemoHelpFormatter(
    argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """Real defaults shown (not ``None``/``False``); description and epilog keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class _Typed(argparse.Action):
    """Stores the value and notes that the user typed the option."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        typed = set(getattr(namespace, "explicit", ()) or ())
        namespace.explicit = frozenset(typed | {self.dest})


def _flag(**kwargs: Any) -> dict[str, Any]:
    """``add_argument`` keywords of a typed on/off flag."""
    return {"action": _Typed, "nargs": 0, "const": True, "default": False, **kwargs}


def _bounded(kind: type, accept: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: a ``kind`` number that ``accept`` takes (NaN never does)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


_at_least_one = _bounded(int, lambda v: v >= 1, "at least 1")
_positive_seconds = _bounded(float, lambda v: 0 < v < math.inf, "a positive number of seconds")
_temperature = _bounded(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` report a bad option as one line (no usage block) and exit 2."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``demo`` subcommand (defaults: those of :class:`DemoOptions`)."""
    default = DemoOptions()
    parser.formatter_class = DemoHelpFormatter
    parser.set_defaults(explicit=frozenset())
    _one_line_errors(parser)
    work = parser.add_argument_group("what to run")
    work.add_argument(
        "--examples",
        type=_at_least_one,
        action=_Typed,
        default=default.examples,
        metavar="N",
        help=f"tasks to run (the example env has {number_of_tasks()})",
    )
    work.add_argument(
        "--rollouts-per-example",
        type=_at_least_one,
        action=_Typed,
        default=default.rollouts_per_example,
        metavar="N",
        help="rollouts per task (a group, as in RL training)",
    )
    work.add_argument(
        "--upstream",
        action=_Typed,
        default=None,
        metavar="URL",
        help="OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1) instead of the "
        "built-in scripted model; needs --model",
    )
    work.add_argument(
        "--model",
        action=_Typed,
        default=None,
        help="model name the --upstream serves",
    )
    work.add_argument(
        "--temperature",
        type=_temperature,
        action=_Typed,
        default=default.temperature,
        help="sampling temperature",
    )
    work.add_argument(
        "--max-tokens",
        type=_at_least_one,
        action=_Typed,
        default=default.max_tokens,
        metavar="N",
        help="completion tokens per turn",
    )
    work.add_argument(
        "--isolation",
        choices=ISOLATION_CHOICES,
        action=_Typed,
        default=default.isolation,
        help="local sandbox isolation; auto takes the strongest this host offers "
        "(process-group = no containment, explicit opt-in only)",
    )
    work.add_argument(
        "--stack",
        choices=("auto", *STACKS),
        action=_Typed,
        default=default.stack,
        help="verifiers stack to run on; auto = the installed verifiers (0.4: v1, 0.3: "
        "classic); naming the other one is an error",
    )
    run = parser.add_argument_group("how to run it")
    run.add_argument(
        "--concurrency",
        type=_at_least_one,
        action=_Typed,
        default=default.concurrency,
        metavar="N",
        help="rollouts running at once",
    )
    run.add_argument(
        "--timeout",
        type=_positive_seconds,
        action=_Typed,
        default=default.timeout,
        metavar="SECONDS",
        help="time limit of the whole run, setup included; finished results are kept",
    )
    where = run.add_mutually_exclusive_group()
    where.add_argument(
        "--output",
        type=Path,
        action=_Typed,
        default=None,
        metavar="DIR",
        help=f"new directory for the results (default: {DEFAULT_OUTPUT_ROOT}/demo-<date>-<time>)",
    )
    where.add_argument(
        "--resume",
        type=Path,
        action=_Typed,
        default=None,
        metavar="DIR",
        help="continue the run in DIR with its settings: rollouts it finished are kept, "
        "failed ones run again",
    )
    run.add_argument(
        "--keep-failed",
        **_flag(help="with --resume: keep the rollouts that failed instead of running them again"),
    )
    run.add_argument(
        "--verbose",
        **_flag(
            help="log the env, sandbox and gateway steps to stderr and print each rollout's "
            "error in full"
        ),
    )


def check_upstream_url(text: str) -> str:
    """``text`` as an http(s) base URL with a host and a valid port (``DemoError`` if not)."""
    text = text.strip()
    parts = urlsplit(text)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https"):
        hint = f" (did you mean http://{text}?)" if "://" not in text else ""
        raise DemoError(f"--upstream {text}: not an http(s) URL{hint}")
    if not parts.hostname or not port_ok:
        raise DemoError(f"--upstream {text}: not a valid base URL (host and port)")
    return text


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Validate parsed arguments into :class:`DemoOptions` (``DemoError`` if invalid).

    Checks what one option's type cannot: options that need each other, and
    ``--examples`` against the example env's tasks.
    """
    explicit = frozenset(getattr(args, "explicit", ()) or ())
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DemoOptions)}
    values["explicit"] = explicit
    options = DemoOptions(**values)
    if options.upstream is not None:
        options = dataclasses.replace(options, upstream=check_upstream_url(options.upstream))
        if not options.model:
            raise DemoError(
                "--upstream needs --model (the model name the upstream serves, as listed "
                "by its /v1/models)"
            )
    elif options.model is not None and options.resume is None:
        raise DemoError(
            "--model names the --upstream's model; without --upstream the built-in "
            "scripted model runs (leave --model out, or add --upstream URL)"
        )
    tasks = number_of_tasks()
    if options.examples > tasks:
        raise DemoError(
            f"--examples {options.examples}: the example env has {tasks} tasks "
            f"(use --examples 1 to {tasks}, and --rollouts-per-example for more rollouts)"
        )
    if options.keep_failed and options.resume is None:
        raise DemoError("--keep-failed: only with --resume DIR (it keeps that run's failures)")
    return options


__all__ = [
    "DEFAULT_OUTPUT_ROOT",
    "ISOLATION_CHOICES",
    "RESULT_SETTINGS",
    "RUN_SETTINGS",
    "STACKS",
    "STACK_HELP",
    "DemoError",
    "DemoHelpFormatter",
    "DemoOptions",
    "add_demo_arguments",
    "check_upstream_url",
    "number_of_tasks",
    "options_from_args",
]
