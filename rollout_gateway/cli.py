"""The ``rollout-gateway`` command line.

Each subcommand is one function decorated with :func:`subcommand`: it receives the
subparsers object, adds its parser and sets ``func`` (the callable run with the parsed
arguments, returning an exit code). Adding a subcommand means adding one such function.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence

SubcommandSetup = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

_SUBCOMMANDS: list[SubcommandSetup] = []


def subcommand(setup: SubcommandSetup) -> SubcommandSetup:
    """Register a function that adds one subcommand's parser (see the module docstring)."""
    _SUBCOMMANDS.append(setup)
    return setup


@subcommand
def add_serve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``rollout-gateway serve``: the reference rollout gateway."""
    p = subparsers.add_parser(
        "serve",
        help="run the rollout gateway in front of OpenAI-compatible upstreams",
        description="Run the rollout gateway (protocol v1) in front of one or more "
        "OpenAI-compatible upstreams (vLLM, the scripted model...).",
    )
    p.add_argument(
        "--upstream",
        action="append",
        required=True,
        metavar="URL",
        help="OpenAI base URL of an upstream, e.g. http://127.0.0.1:8001/v1 (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--require-rollout-keys",
        action="store_true",
        help="register returns a per-rollout api_key that chat requests must present",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("ROLLOUT_GATEWAY_ADMIN_TOKEN"),
        help="bearer token required by register/cancel/unregister/trajectory "
        "(default: $ROLLOUT_GATEWAY_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--upstream-api-key",
        default=os.environ.get("ROLLOUT_GATEWAY_UPSTREAM_API_KEY"),
        help="bearer token sent to the upstreams (default: $ROLLOUT_GATEWAY_UPSTREAM_API_KEY)",
    )
    p.add_argument(
        "--rollout-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="forget a rollout idle this long",
    )
    p.add_argument(
        "--max-rollouts", type=int, default=10_000, metavar="N", help="registered rollouts at most"
    )
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds per upstream request",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        metavar="N",
        help="largest request body accepted",
    )
    p.add_argument("--disabled", action="store_true", help="start disabled: register answers 503")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Run ``serve`` with parsed arguments."""
    from rollout_gateway.server import GatewayConfig, create_app, serve

    config = GatewayConfig(
        upstreams=args.upstream,
        enabled=not args.disabled,
        require_rollout_keys=args.require_rollout_keys,
        admin_token=args.admin_token or None,
        rollout_ttl_s=args.rollout_ttl,
        max_rollouts=args.max_rollouts,
        upstream_timeout_s=args.upstream_timeout,
        max_body_bytes=args.max_body_bytes,
        upstream_api_key=args.upstream_api_key or None,
    )
    _setup_logging(args.log_level)
    serve(create_app(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0


@subcommand
def add_scripted_model_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``rollout-gateway scripted-model``: the deterministic scripted upstream."""
    p = subparsers.add_parser(
        "scripted-model",
        help="run the scripted OpenAI-compatible model (base URL http://HOST:PORT/v1)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8001, help="port to listen on")
    p.add_argument("--latency-ms", type=float, default=0.0, help="added latency per completion")
    p.add_argument("--model-name", default="scripted", help="model name it answers to")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.set_defaults(func=run_scripted_model)


def run_scripted_model(args: argparse.Namespace) -> int:
    """Run ``scripted-model`` with parsed arguments."""
    from rollout_gateway.scripted import create_scripted_model_app
    from rollout_gateway.server import serve

    _setup_logging(args.log_level)
    app = create_scripted_model_app(model_name=args.model_name, latency_ms=args.latency_ms)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _demo_help_formatter() -> type[argparse.HelpFormatter]:
    from rollout_gateway.demo.options import DemoHelpFormatter

    class DemoHelp(DemoHelpFormatter):
        """Help of ``demo``: the epilog says which sandbox isolation this host offers (probed
        only when help is shown)."""

        def _format_text(self, text: str) -> str:
            if text == _ISOLATION_EPILOG:
                text = _isolation_help()
            return super()._format_text(text)

    return DemoHelp


_ISOLATION_EPILOG = "{isolation}"


def _isolation_help() -> str:
    from rollout_gateway.local_sandbox import FALLBACK_ORDER, unavailable_reasons

    reasons = unavailable_reasons()
    lines = ["local sandbox isolation (strongest first; auto takes the first available):"]
    for mode in FALLBACK_ORDER:
        lines.append(f"  {mode:<14}{'available' if reasons[mode] is None else reasons[mode]}")
    lines.append("  process-group no containment: only with --isolation process-group")
    lines.append(
        "results: DIR/results.jsonl (one rollout per line, written as each finishes) and "
        "DIR/metadata.json"
    )
    return "\n".join(lines)


@subcommand
def add_demo_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``rollout-gateway demo``: the whole system on one machine."""
    from rollout_gateway.demo import add_demo_arguments

    p = subparsers.add_parser(
        "demo",
        help="run the example env end to end on this machine",
        description="Start the scripted model (or use --upstream) and the reference gateway "
        "on loopback, run the example env (rollout_gateway.examples.fix_bug_env) in gateway "
        "mode on contained local sandboxes, show progress, and write each rollout to "
        "DIR/results.jsonl as it finishes. Ctrl-C or SIGTERM stops cleanly (finished results "
        "kept, sandboxes removed); --resume DIR continues.",
        epilog=_ISOLATION_EPILOG,
    )
    add_demo_arguments(p)
    p.formatter_class = _demo_help_formatter()
    p.set_defaults(func=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    """Run ``demo`` with parsed arguments."""
    from rollout_gateway.demo import DemoError, options_from_args, run_demo

    try:
        options = options_from_args(args)
    except DemoError as e:
        print(f"demo: {e}")
        return 2
    return run_demo(options)


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
    parser = argparse.ArgumentParser(prog="rollout-gateway", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="show the version"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for setup in _SUBCOMMANDS:
        setup(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-gateway`` command."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
