"""What ``rollout-gateway demo`` runs: its options, their command-line form and checks."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

#: Where results go when neither ``--output`` nor ``--resume`` is given.
DEFAULT_OUTPUT_ROOT = Path("outputs")
#: The env the demo runs (an importable module: also the ``vf-eval`` env id).
ENV_ID = "rollout_gateway.examples.fix_bug_env"


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
    verbose: bool = False

    def recorded(self) -> dict[str, object]:
        """The options as stored in ``metadata.json`` (what ``--resume`` reuses)."""
        values = dataclasses.asdict(self)
        for key in ("output", "resume"):
            values[key] = str(values[key]) if values[key] is not None else None
        return values


#: Options a resumed run takes from the interrupted run's metadata (the work itself).
RESUMED_FIELDS = (
    "examples",
    "rollouts_per_example",
    "upstream",
    "model",
    "temperature",
    "max_tokens",
)


class DemoHelpFormatter(
    argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """Real defaults shown (not ``None``/``False``); description and epilog keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``demo`` subcommand (defaults: those of :class:`DemoOptions`)."""
    default = DemoOptions()
    parser.formatter_class = DemoHelpFormatter
    parser.add_argument(
        "--examples", type=int, default=default.examples, help="number of tasks to run"
    )
    parser.add_argument(
        "--rollouts-per-example",
        type=int,
        default=default.rollouts_per_example,
        help="rollouts per task (a group, as in RL training)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=default.concurrency, help="rollouts running at once"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="DIR",
        help="new directory for results.jsonl and metadata.json "
        f"(default: {DEFAULT_OUTPUT_ROOT}/demo-<date>-<time>)",
    )
    where.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="continue an interrupted run in DIR: its settings are reused and the rollouts "
        "already in its results.jsonl are skipped",
    )
    parser.add_argument(
        "--upstream",
        default=None,
        metavar="URL",
        help="OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1) instead of the "
        "built-in scripted model",
    )
    parser.add_argument(
        "--model", default=None, help="model name the upstream serves (required with --upstream)"
    )
    parser.add_argument(
        "--temperature", type=float, default=default.temperature, help="sampling temperature"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=default.max_tokens, help="completion tokens per turn"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=default.timeout,
        metavar="SECONDS",
        help="time limit of the whole run; finished results are kept",
    )
    parser.add_argument(
        "--isolation",
        default=default.isolation,
        choices=["auto", "bwrap", "unshare", "uid", "process-group"],
        help="local sandbox isolation; auto takes the strongest this host offers "
        "(process-group = no containment, explicit opt-in only)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="log the env, sandbox and gateway steps to stderr and print each rollout's error "
        "in full",
    )


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Validate parsed arguments into :class:`DemoOptions` (``DemoError`` if invalid)."""
    if args.examples < 1 or args.rollouts_per_example < 1 or args.concurrency < 1:
        raise DemoError("--examples, --rollouts-per-example and --concurrency must be >= 1")
    if args.upstream and not args.model:
        raise DemoError("--upstream needs --model (the model name the upstream serves)")
    if not args.timeout > 0:  # written so that NaN is refused too
        raise DemoError("--timeout must be positive")
    if not args.temperature >= 0:
        raise DemoError("--temperature must be >= 0")
    if args.max_tokens < 1:
        raise DemoError("--max-tokens must be >= 1")
    return DemoOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoOptions)})


__all__ = [
    "DEFAULT_OUTPUT_ROOT",
    "ENV_ID",
    "RESUMED_FIELDS",
    "DemoError",
    "DemoHelpFormatter",
    "DemoOptions",
    "add_demo_arguments",
    "options_from_args",
]
