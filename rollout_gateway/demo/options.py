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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_gateway.agent_clis import AGENT_CLIS
from rollout_gateway.options import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    Bound,
    add_options,
    base_url_problem,
    one_line_errors,
    option,
    typed_options,
)

#: Where results go when neither ``--output`` nor ``--resume`` is given.
DEFAULT_OUTPUT_ROOT = Path("outputs")
#: The verifiers stacks the demo runs on (``auto``: the installed one).
STACKS = ("classic", "v1")
ISOLATION_CHOICES = ("auto", "bwrap", "unshare", "uid", "process-group")
#: ``--agent``: the example env's own agent, or a real CLI (:mod:`.agents`).
AGENT_CHOICES = ("example", *AGENT_CLIS)
_CLIS = ", ".join(f"{cli.name} ({cli.spec})" for cli in AGENT_CLIS.values())


class DemoError(RuntimeError):
    """Something the user can fix stops the demo; the message says what and how."""


_WORK = "what to run"
_RUN = "how to run it"
#: ``--timeout``: the whole run's time limit.
SECONDS = Bound(float, lambda v: 0 < v < math.inf, "a positive number of seconds")


@dataclass(frozen=True)
class DemoOptions:
    """What ``rollout-gateway demo`` runs (each field one option: its flag, default, check
    and help; see :mod:`rollout_gateway.options`)."""

    examples: int = option(
        3, flag="--examples", bound=AT_LEAST_ONE, metavar="N", group=_WORK,
        help="tasks to run (the example env has {tasks})",
    )  # fmt: skip
    rollouts_per_example: int = option(
        3, flag="--rollouts-per-example", bound=AT_LEAST_ONE, metavar="N", group=_WORK,
        help="rollouts per task (a group, as in RL training)",
    )  # fmt: skip
    concurrency: int = option(
        9, flag="--concurrency", bound=AT_LEAST_ONE, metavar="N", group=_RUN,
        help="rollouts running at once",
    )  # fmt: skip
    output: Path | None = option(
        None, flag="--output", convert=Path, metavar="DIR", group=_RUN, exclusive="where",
        help=f"new directory for the results (default: {DEFAULT_OUTPUT_ROOT}/demo-<date>-<time>)",
    )  # fmt: skip
    resume: Path | None = option(
        None, flag="--resume", convert=Path, metavar="DIR", group=_RUN, exclusive="where",
        help="continue the run in DIR with its settings: rollouts it finished are kept, "
        "failed ones run again",
    )  # fmt: skip
    agent: str = option(
        "example", flag="--agent", choices=AGENT_CHOICES, group=_WORK,
        help="the agent in each sandbox: example (the example env's OpenAI-SDK agent) or "
        f"a real CLI on the same tasks: {_CLIS}; install a CLI once with npm: python -m "
        "rollout_gateway.agent_clis install NAME",
    )  # fmt: skip
    upstream: str | None = option(
        None, flag="--upstream", metavar="URL", group=_WORK,
        help="OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1) instead of the "
        "built-in scripted model; needs --model",
    )  # fmt: skip
    model: str | None = option(
        None, flag="--model", group=_WORK, help="model name the --upstream serves"
    )
    temperature: float = option(
        0.7, flag="--temperature", bound=NON_NEGATIVE, group=_WORK, help="sampling temperature"
    )
    max_tokens: int = option(
        512, flag="--max-tokens", bound=AT_LEAST_ONE, metavar="N", group=_WORK,
        help="completion tokens per turn",
    )  # fmt: skip
    timeout: float = option(
        300.0, flag="--timeout", bound=SECONDS, metavar="SECONDS", group=_RUN,
        help="time limit of the whole run, setup included; finished results are kept",
    )  # fmt: skip
    isolation: str = option(
        "auto", flag="--isolation", choices=ISOLATION_CHOICES, group=_WORK,
        help="local sandbox isolation; auto takes the strongest this host offers "
        "(process-group = no containment, explicit opt-in only)",
    )  # fmt: skip
    stack: str = option(
        "auto", flag="--stack", choices=("auto", *STACKS), group=_WORK,
        help="verifiers stack to run on; auto = the installed verifiers (0.4: v1, 0.3: "
        "classic); naming the other one is an error",
    )  # fmt: skip
    keep_failed: bool = option(
        False, flag="--keep-failed", group=_RUN,
        help="with --resume: keep the rollouts that failed instead of running them again",
    )  # fmt: skip
    verbose: bool = option(
        False, flag="--verbose", group=_RUN,
        help="log the env, sandbox and gateway steps to stderr and print each rollout's "
        "error in full",
    )  # fmt: skip
    #: The options the user gave on the command line (their field names).
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    def recorded(self) -> dict[str, Any]:
        """The settings stored in ``metadata.json`` (what ``--resume`` reuses)."""
        return {name: getattr(self, name) for name in (*RESULT_SETTINGS, *RUN_SETTINGS)}


#: Settings that decide what a run's rollouts are: a resumed run keeps them, and refuses a
#: typed value that differs (the results would mix two experiments).
RESULT_SETTINGS = (
    "agent",
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
        "demo's settings, status, counts, resumes). vf-eval @ "
        "DIR/configs/resolved/eval.json --resume continues it against a gateway at the "
        "address it names; vf-replay DIR --no-rich re-scores it offline, which for the "
        "example (its reward runs the task's test in the sandbox) scores nothing.",
    ),
}


def number_of_tasks() -> int:
    """Tasks of the example env (the same tasks on both stacks)."""
    from rollout_gateway.examples.fix_bug_env.tasks import TASKS

    return len(TASKS)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``demo`` subcommand: one per :class:`DemoOptions` field, which
    declares it. A bad one is one line, no usage block (exit code 2)."""
    one_line_errors(parser, "rollout-gateway demo --help lists the options")
    # The work options first, as a user reads them; each group in declaration order.
    add_options(parser, DemoOptions, fill={"tasks": str(number_of_tasks())})


def check_upstream_url(text: str) -> str:
    """``text`` as an http(s) base URL with a host and a valid port (``DemoError`` if not)."""
    problem = base_url_problem(text)
    if problem is not None:
        raise DemoError(f"--upstream {text.strip()}: {problem}")
    return text.strip()


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Validate parsed arguments into :class:`DemoOptions` (``DemoError`` if invalid).

    Checks what one option's type cannot: options that need each other, and
    ``--examples`` against the example env's tasks.
    """
    explicit = typed_options(args)
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
    "AGENT_CHOICES",
    "DEFAULT_OUTPUT_ROOT",
    "ISOLATION_CHOICES",
    "RESULT_SETTINGS",
    "RUN_SETTINGS",
    "STACKS",
    "STACK_HELP",
    "DemoError",
    "DemoOptions",
    "add_demo_arguments",
    "check_upstream_url",
    "number_of_tasks",
    "options_from_args",
]
