"""The ``rollout-gateway`` command line.

Each subcommand is one function decorated with :func:`subcommand`: it receives the
subparsers object, adds its parser and sets ``func`` (the callable run with the parsed
arguments, returning an exit code). Adding a subcommand means adding one such function.
Flags are generated from declared options (:mod:`rollout_gateway.options`): ``serve``'s
from the gateway's settings (:mod:`rollout_gateway.serve_command`), ``scripted-model``'s
from :class:`ScriptedModelProcess`, ``demo``'s from ``DemoOptions``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_gateway.options import (
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    PORT,
    POSITIVE_INT,
    SHARE_OR_NONE,
    add_options,
    one_line_errors,
    option,
)
from rollout_gateway.serve_command import (
    ServeOptionError,
    add_serve_arguments,
    log_level_option,
    prepare_admin_token_file,
    serve_config,
    served_model_path,
)

if TYPE_CHECKING:
    pass

#: Exit status after Ctrl-C (SIGINT): 128 + 2, as shells report it.
EXIT_SIGINT = 130

SubcommandSetup = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

_SUBCOMMANDS: list[SubcommandSetup] = []


def subcommand(setup: SubcommandSetup) -> SubcommandSetup:
    """Register a function that adds one subcommand's parser (see the module docstring)."""
    _SUBCOMMANDS.append(setup)
    return setup


_SERVE_EPILOG = """\
security model:
  The control plane (register, trajectory, cancel, unregister, /metrics, upstream
  details of /health) needs "Authorization: Bearer <admin token>". The token is read
  from $ROLLOUT_GATEWAY_ADMIN_TOKEN or from a file (--admin-token-file or
  $ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE), never from the command line (it would show in ps),
  and has at least 16 characters. --create-admin-token writes a fresh one to that file
  (mode 0600) when it does not exist; the env reads the same file through
  $ROLLOUT_GATEWAY_ADMIN_TOKEN_FILE. Without a token, serve refuses to start unless
  --open-control-plane is given, which only binds to a loopback address.
  Register hands out a per-rollout api_key (on by default, --no-rollout-keys to turn
  off): an agent presents it as its bearer token and reaches only its own rollout, on
  /v1/rollouts/{id}/chat/completions or on /v1/chat/completions (routed by the key).
  Agents get short error messages; upstream URLs and tracebacks go to the log only.

what an agent may set:
  forwarded: messages, tools, tool_choice, parallel_tool_calls, response_format, stop.
  read: max_tokens / max_completion_tokens (used only if registration sets none),
  stream, stream_options, logprobs, return_token_ids (shape the answer); model and
  top_logprobs are ignored.
  Every other field (temperature, top_p, top_k, n, seed, logit_bias, ...) is dropped,
  never rejected; the turn's extras list the dropped names. The registered
  sampling_params are what the engine gets.

refused turns:
  a turn past a rollout's budget, or of a cancelled/completed rollout, is answered
  403 (not retried by OpenAI SDKs, unlike 409) with error.code naming the reason
  (max_turns_reached, max_completion_tokens_reached, max_context_reached,
  max_rollout_bytes_reached, rollout_cancelled, rollout_completed); the trajectory
  then has is_truncated=true and truncation_reason. A retry (same Idempotency-Key, or
  the same body while the turn runs or within --retry-window of its answer) gets the
  turn's answer and is not a new turn.
"""


@subcommand
def add_serve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``rollout-gateway serve``: the reference rollout gateway."""
    p = subparsers.add_parser(
        "serve",
        help="run the rollout gateway in front of OpenAI-compatible upstreams",
        description="Run the rollout gateway (protocol v1) in front of one or more "
        "OpenAI-compatible upstreams (vLLM, the scripted model...).",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(p)
    one_line_errors(p, "rollout-gateway serve --help lists the options")
    p.set_defaults(func=run_serve, command_parser=p)


def run_serve(args: argparse.Namespace) -> int:
    """Run ``serve`` with parsed arguments (exit code 2 on invalid options)."""
    from rollout_gateway.server import create_app, serve
    from rollout_gateway.server.engines.token_in import TokenInUnavailable
    from rollout_gateway.server.http.fds import raise_fd_limit
    from rollout_gateway.server.ops.gc_tuning import tune_for_serving
    from rollout_gateway.server.state.store import StoreError

    # This process only serves: as many connections as the hard limit allows.
    raise_fd_limit()
    try:
        notice = prepare_admin_token_file(args)
        config = serve_config(args)
    except ValueError as e:  # ServeOptionError, or GatewayConfig's own checks
        print(f"rollout-gateway serve: error: {e}", file=sys.stderr)
        return 2
    for line in (notice or "").splitlines():
        print(f"rollout-gateway serve: {line}", file=sys.stderr, flush=True)
    _setup_logging(args.log_level)
    if not _port_free("serve", args.host, args.port):
        return 2
    try:
        app = create_app(config)
        tune_for_serving()  # this process only serves: see server/ops/gc_tuning.py
        # The store is opened on the loop that serves, before the server binds: a store
        # that cannot be used is refused here, with its reason, instead of a gateway that
        # starts and fails its first turn.
        serve(app, host=args.host, port=args.port, log_level=args.log_level, loop=args.loop)
    except StoreError as e:
        option = "--redis" if config.state.redis_url is not None else "--state-dir"
        print(f"rollout-gateway serve: error: {option}: {e}", file=sys.stderr)
        return 2
    except (TokenInUnavailable, ValueError) as e:  # the message names the option
        # ValueError: what the process's limits cannot hold (--max-connections).
        print(f"rollout-gateway serve: error: {e}", file=sys.stderr)
        return 2
    return 0


def _port_free(command: str, host: str, port: int) -> bool:
    """Whether ``host``:``port`` can be listened on; if not, say so in one line naming
    ``--port`` (uvicorn's own report is a log line among others, and exit status 3)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn
            probe.bind(address)
    except OSError as e:
        reason = e.strerror or str(e)
        print(
            f"rollout-gateway {command}: error: --host {host} --port {port}: cannot listen "
            f"there ({reason}); another server may hold it: choose another --port",
            file=sys.stderr,
        )
        return False
    return True


@dataclass(frozen=True)
class ScriptedModelProcess:
    """``rollout-gateway scripted-model``'s options."""

    host: str = option("127.0.0.1", flag="--host", help="address to listen on")
    port: int = option(8001, flag="--port", bound=PORT, help="port to listen on")
    latency_ms: float = option(
        0.0, flag="--latency-ms", bound=NON_NEGATIVE, help="added latency per completion"
    )
    model_name: str = option("scripted", flag="--model-name", help="model name it answers to")
    # rollout_gateway.scripted.context.DEFAULT_MAX_MODEL_LEN (not imported: the command
    # line loads no server module until it runs one; a test holds the two equal).
    max_model_len: int = option(
        1_048_576, flag="--max-model-len", bound=NON_NEGATIVE_INT, metavar="N",
        help="the context it serves, in tokens (0: no limit); a request that does not fit is "
        "refused with the engine's 400, as --context-check says",
    )  # fmt: skip
    context_check: str = option(
        "vllm", flag="--context-check", choices=("vllm", "sglang"),
        help="check requests against the context as vLLM 0.32 does (a max_tokens over the "
        "context is refused; a smaller one is fitted to the room the prompt leaves) or as "
        "SGLang does (a prompt plus max_tokens over the context is refused)",
    )  # fmt: skip
    bytes_per_token: int = option(
        1, flag="--bytes-per-token", bound=POSITIVE_INT, metavar="N",
        help="1: one token per byte; N: text in chunks of N bytes, one id each in a real "
        "vocabulary's range (a real tokenizer's bytes per token, for benchmarks)",
    )  # fmt: skip
    fault_error_rate: float = option(
        0.0, flag="--fault-error-rate", bound=SHARE_OR_NONE, metavar="P", group="faults",
        help="answer this share of chat requests with a 500, on purpose (soak runs)",
    )  # fmt: skip
    fault_slow_rate: float = option(
        0.0, flag="--fault-slow-rate", bound=SHARE_OR_NONE, metavar="P", group="faults",
        help="make this share of answers --fault-slow-s seconds slower",
    )  # fmt: skip
    fault_slow_s: float = option(
        5.0, flag="--fault-slow-s", bound=NON_NEGATIVE, metavar="S", group="faults",
        help="how much slower a slow answer is",
    )  # fmt: skip
    fault_drop_rate: float = option(
        0.0, flag="--fault-drop-rate", bound=SHARE_OR_NONE, metavar="P", group="faults",
        help="drop the connection in the middle of this share of answers",
    )  # fmt: skip
    fault_seed: int = option(
        0, flag="--fault-seed", bound=NON_NEGATIVE_INT, metavar="N", group="faults",
        help="seed of the faults' random draws (the same seed, the same faults)",
    )  # fmt: skip
    ledger: str | None = option(
        None, flag="--ledger", metavar="PATH", group="faults", default_text="none",
        help="append a JSON line per completion served whole (its serial, also in the "
        "answer's usage.call, and a digest of its ids) to PATH",
    )  # fmt: skip
    log_level: str = log_level_option()


@subcommand
def add_scripted_model_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``rollout-gateway scripted-model``: the deterministic scripted upstream."""
    p = subparsers.add_parser(
        "scripted-model",
        help="run the scripted OpenAI-compatible model (base URL http://HOST:PORT/v1)",
    )
    add_options(p, ScriptedModelProcess)
    one_line_errors(p, "rollout-gateway scripted-model --help lists the options")
    p.set_defaults(func=run_scripted_model, command_parser=p)


def run_scripted_model(args: argparse.Namespace) -> int:
    """Run ``scripted-model`` with parsed arguments."""
    from rollout_gateway.scripted import create_scripted_model_app
    from rollout_gateway.server import serve

    _setup_logging(args.log_level)
    if not _port_free("scripted-model", args.host, args.port):
        return 2
    from pathlib import Path

    from rollout_gateway.scripted.faults import FaultPlan, Ledger

    faults = FaultPlan(
        error_rate=args.fault_error_rate,
        slow_rate=args.fault_slow_rate,
        slow_s=args.fault_slow_s,
        drop_rate=args.fault_drop_rate,
        seed=args.fault_seed,
    )
    app = create_scripted_model_app(
        model_name=args.model_name,
        latency_ms=args.latency_ms,
        max_model_len=args.max_model_len or None,
        bytes_per_token=args.bytes_per_token,
        context_check=args.context_check,
        faults=faults if faults.active else None,
        ledger=Ledger(Path(args.ledger)) if args.ledger else None,
    )
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _add_demo_needs_a_stack(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``demo`` where no verifiers stack is installed: its help and its run say which
    extra it needs; nothing is probed, imported or created."""
    from rollout_gateway.demo.help import CommandTextFormatter, needs_a_stack

    p = subparsers.add_parser(
        "demo",
        help="run the example env end to end on this machine (needs a verifiers extra)",
        description=f"Run the example env end to end on this machine: {needs_a_stack()}.",
        formatter_class=CommandTextFormatter,
    )

    def refuse(args: argparse.Namespace) -> int:
        print(f"rollout-gateway demo: error: {needs_a_stack()}", file=sys.stderr)
        return 2

    # Any demo option is taken (and ignored): the missing extra is the error to report.
    p.set_defaults(func=refuse, takes_any_options=True)


@subcommand
def add_demo_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``rollout-gateway demo``: the whole system on one machine (the installed stack)."""
    from rollout_gateway.verifiers_stack import installed_stack

    if installed_stack() is None:
        _add_demo_needs_a_stack(subparsers)
        return
    from rollout_gateway.demo import add_demo_arguments
    from rollout_gateway.demo.help import DESCRIPTION, EPILOG, DemoHelpFormatter

    p = subparsers.add_parser(
        "demo",
        help="run the example env end to end on this machine (on the installed verifiers)",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    add_demo_arguments(p)
    p.formatter_class = DemoHelpFormatter
    p.set_defaults(func=run_demo_command, command_parser=p)


def run_demo_command(args: argparse.Namespace) -> int:
    """Run ``demo`` with parsed arguments (exit code 2, one line, on invalid options)."""
    from rollout_gateway.demo import DemoError, options_from_args, run_demo
    from rollout_gateway.demo.threads import exit_if_work_abandoned, off_loop_threads

    try:
        options = options_from_args(args)
    except DemoError as e:
        print(f"rollout-gateway demo: error: {e}", file=sys.stderr)
        return 2
    before = off_loop_threads()
    code = run_demo(options)
    if getattr(args, "own_process", False):
        # A stop during setup: don't wait for the import. Only when the demo is this
        # process's command: called in-process (main(argv), the tests), ending the
        # process would end the caller's too (pytest once exited 2 with no summary).
        exit_if_work_abandoned(code, before)
    return code


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("rollout-gateway")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    # httpx logs every upstream request at INFO; the gateway's own turn line says more.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def build_parser() -> argparse.ArgumentParser:
    """The full parser, one subparser per registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="rollout-gateway",
        description="The rollout-gateway command line: serve the gateway, a scripted model, "
        "or run the demo.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="show the version"
    )
    one_line_errors(parser, "rollout-gateway --help lists the commands")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for setup in _SUBCOMMANDS:
        setup(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-gateway`` command."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any_options", False):
        # Reported by the subcommand's parser, in one line.
        command_parser = getattr(args, "command_parser", None) or parser
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.own_process = argv is None  # the command line, not a call from other code
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C (SIGINT): the servers have shut down cleanly by now (uvicorn says so);
        # a traceback would only say where the signal landed. 130 = 128 + SIGINT, what
        # a shell reports for a program Ctrl-C stopped, and what the demo exits with.
        return EXIT_SIGINT


__all__ = [
    "ScriptedModelProcess",
    "ServeOptionError",
    "build_parser",
    "main",
    "prepare_admin_token_file",
    "serve_config",
    "served_model_path",
    "subcommand",
]


if __name__ == "__main__":
    raise SystemExit(main())
