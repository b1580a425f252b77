"""``rollout-gateway demo``: the whole system on one machine, for real.

Starts the scripted model (or uses ``--upstream``) and the reference gateway on loopback,
runs the example env (``fix_bug_env``) in gateway mode on local sandboxes (real agent
processes making real model calls through the gateway), prints progress and a summary,
writes the results as JSONL in verifiers' output format (trajectory steps with token ids
and logprobs), and shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

DEFAULT_OUTPUT_DIR = Path("outputs")


@dataclass(frozen=True)
class DemoOptions:
    """What ``rollout-gateway demo`` runs."""

    examples: int = 3
    rollouts_per_example: int = 3
    concurrency: int = 9
    output: Path | None = None
    upstream: str | None = None
    model: str | None = None
    temperature: float = 0.7
    timeout: float = 300.0
    verbose: bool = False


class DemoError(RuntimeError):
    """A piece of the demo could not start; the message says which and why."""


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``demo`` subcommand (defaults: those of :class:`DemoOptions`)."""
    default = DemoOptions()
    parser.add_argument(
        "--examples", type=int, default=default.examples, help="tasks to run (%(default)s)"
    )
    parser.add_argument(
        "--rollouts-per-example",
        type=int,
        default=default.rollouts_per_example,
        help="rollouts per task (%(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=default.concurrency,
        help="rollouts at once (%(default)s)",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="results JSONL (default outputs/demo-*.jsonl)"
    )
    parser.add_argument(
        "--upstream",
        default=None,
        help="OpenAI-compatible base URL to use instead of the scripted model",
    )
    parser.add_argument("--model", default=None, help="model name (required with --upstream)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=default.temperature,
        help="sampling temperature (%(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=default.timeout,
        help="whole-demo time limit, seconds (%(default)s)",
    )
    parser.add_argument("--verbose", action="store_true", help="show library logs")


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Validate parsed arguments into :class:`DemoOptions` (``DemoError`` if invalid)."""
    if args.examples < 1 or args.rollouts_per_example < 1 or args.concurrency < 1:
        raise DemoError("--examples, --rollouts-per-example and --concurrency must be >= 1")
    if args.upstream and not args.model:
        raise DemoError("--upstream needs --model (the model name the upstream serves)")
    if args.timeout <= 0:
        raise DemoError("--timeout must be positive")
    return DemoOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoOptions)})


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Run the demo; returns the process exit code (0: every rollout ran cleanly).

    Progress and the summary go to ``out`` (default: the current ``sys.stdout``).
    """
    out = out or sys.stdout
    if not options.verbose:
        for name in ("verifiers", "rollout_gateway", "httpx", "uvicorn"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        return asyncio.run(asyncio.wait_for(_demo(options, out), timeout=options.timeout))
    except TimeoutError:
        print(f"demo: gave up after {options.timeout:.0f} s (see --timeout)", file=out)
        return 3
    except DemoError as e:
        print(f"demo: {e}", file=out)
        return 2


async def _serve(stack: contextlib.AsyncExitStack, app: Any, what: str) -> str:
    """Serve ``app`` on loopback until ``stack`` closes; a failed start is a DemoError."""
    from rollout_gateway.server import running_server

    try:
        return await stack.enter_async_context(running_server(app))
    except Exception as e:
        raise DemoError(f"could not start the {what}: {e}") from e


async def _demo(options: DemoOptions, out: TextIO) -> int:
    import verifiers as vf
    from openai import AsyncOpenAI

    from rollout_gateway.scripted import create_scripted_model_app
    from rollout_gateway.server import GatewayConfig, create_app

    try:
        import fix_bug_env
    except ImportError as e:
        raise DemoError(
            "the example env is not installed: pip install -e examples/fix_bug_env"
        ) from e

    # Closed in reverse: the env's teardown, then the gateway, then the scripted model.
    async with contextlib.AsyncExitStack() as stack:
        if options.upstream:
            upstream, model = options.upstream.rstrip("/"), str(options.model)
        else:
            model_root = await _serve(stack, create_scripted_model_app(), "scripted model")
            upstream, model = f"{model_root}/v1", options.model or "scripted"
            print(f"scripted model  {upstream}", file=out)
        admin_token = secrets.token_urlsafe(32)  # the gateway's control plane is protected
        gateway_app = create_app(GatewayConfig(upstreams=[upstream], admin_token=admin_token))
        gateway_root = await _serve(stack, gateway_app, "gateway")
        print(f"rollout gateway {gateway_root}  (upstream {upstream})", file=out)
        env = fix_bug_env.load_environment(
            num_examples=options.examples,
            use_gateway=True,
            sandbox_backend="local",
            tunnel_provider="direct",
            timeout_seconds=min(options.timeout, 600.0),
            gateway_admin_token=admin_token,
        )
        stack.push_async_callback(env._teardown)
        client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=f"{gateway_root}/v1", api_key="demo")
        )
        outputs = await _run_rollouts(env, client, model, options, out)

    path = options.output or DEFAULT_OUTPUT_DIR / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    _write_jsonl(path, outputs)
    return _summarize(outputs, path, out)


async def _run_rollouts(
    env: Any, client: Any, model: str, options: DemoOptions, out: TextIO
) -> list[dict[str, Any]]:
    dataset = env.get_dataset(n=options.examples)
    inputs = [
        {key: row[key] for key in ("prompt", "answer", "info", "example_id") if key in row}
        for row in dataset
        for _ in range(options.rollouts_per_example)
    ]
    total = len(inputs)
    print(
        f"running {total} rollouts ({options.examples} tasks x {options.rollouts_per_example}) "
        f"on local sandboxes, {options.concurrency} at once",
        file=out,
    )
    limit = asyncio.Semaphore(options.concurrency)
    done = 0
    sampling = {"temperature": options.temperature, "max_tokens": 512}

    async def one(row: dict[str, Any]) -> dict[str, Any]:
        nonlocal done
        async with limit:
            started = time.monotonic()
            output = await env.run_rollout(
                row, client, model, sampling, state_columns=["trajectory"]
            )
            output["demo_duration_s"] = time.monotonic() - started
        done += 1
        line = _row(output)
        print(f"[{done:>{len(str(total))}}/{total}] {line}", file=out, flush=True)
        return dict(output)

    return list(await asyncio.gather(*(one(row) for row in inputs)))


def _tokens(output: dict[str, Any]) -> tuple[int, int]:
    steps = output.get("trajectory") or []
    with_tokens = [s["tokens"] for s in steps if s.get("tokens")]
    prompt = len(with_tokens[-1]["prompt_ids"]) if with_tokens else 0
    completion = sum(len(t["completion_ids"]) for t in with_tokens)
    return prompt, completion


def _row(output: dict[str, Any]) -> str:
    prompt, completion = _tokens(output)
    error = output.get("error")
    error_text = f"{error['error']}: {error['message'][:60]}" if error else "-"
    return (
        f"example={output['example_id']} reward={output.get('reward', 0.0):.1f} "
        f"turns={len(output.get('trajectory') or [])} prompt_tokens={prompt} "
        f"completion_tokens={completion} duration={output.get('demo_duration_s', 0.0):.2f}s "
        f"error={error_text}"
    )


def _write_jsonl(path: Path, outputs: list[dict[str, Any]]) -> None:
    from verifiers.utils.save_utils import make_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for output in outputs:
            f.write(json.dumps(output, default=make_serializable) + "\n")


def _summarize(outputs: list[dict[str, Any]], path: Path, out: TextIO) -> int:
    import verifiers as vf

    rewards = [float(o.get("reward") or 0.0) for o in outputs]
    infra = [o for o in outputs if o.get("error") and _is_infra(o["error"], vf)]
    other = [o for o in outputs if o.get("error") and o not in infra]
    steps = [s for o in outputs for s in (o.get("trajectory") or [])]
    with_ids = sum(1 for s in steps if s.get("tokens") and s["tokens"].get("completion_ids"))
    print("\nsummary", file=out)
    print(f"  rollouts            {len(outputs)}", file=out)
    print(f"  mean reward         {sum(rewards) / max(len(rewards), 1):.3f}", file=out)
    print(f"  infra errors        {len(infra)}", file=out)
    print(f"  other errors        {len(other)}", file=out)
    print(f"  turns with token ids {with_ids}/{len(steps)}", file=out)
    print(f"  results             {path}", file=out)
    return 1 if infra or other else 0


def _is_infra(error: dict[str, Any], vf: Any) -> bool:
    """Whether a serialized error names ``vf.InfraError`` or one of its subclasses."""
    names: set[str] = set()
    pending = [vf.InfraError]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return error.get("error") in names


__all__ = ["DemoError", "DemoOptions", "add_demo_arguments", "options_from_args", "run_demo"]
