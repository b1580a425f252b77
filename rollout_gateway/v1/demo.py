"""``rollout-gateway demo`` on verifiers 0.4: the v1 example in gateway mode, on one machine.

Runs the scripted model (or ``--upstream``), the reference gateway and the
``fix-bug-v1`` example's agents on v1's subprocess runtime through
:class:`GatewayInterception`, prints one line per rollout and a summary, and writes the
traces as JSONL. ``rollout-gateway demo`` runs this when verifiers 0.4 is installed.

It honours ``--max-tokens``, ``--timeout`` (the finished traces are kept; exit code 3)
and ``--verbose`` (each failed rollout's errors in full) as the 0.3 demo does, and
refuses ``--resume`` and ``--isolation``: it writes no ``metadata.json`` to resume from,
and its agents run on v1's subprocess runtime, not in local sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from pathlib import Path
from typing import Any, TextIO

from rollout_gateway.demo.options import DEFAULT_OUTPUT_ROOT, DemoError, DemoOptions
from rollout_gateway.demo.runner import EXIT_FAILED_ROLLOUTS, EXIT_OK, EXIT_TIMEOUT


async def run_v1_demo(options: DemoOptions, out: TextIO) -> int:
    """The v1 demo; returns the exit code (0: every rollout ran cleanly, 1: some failed,
    3: the run's time limit came first)."""
    _refuse_unsupported(options)
    import verifiers.v1 as vf

    from rollout_gateway.scripted import create_scripted_model_app
    from rollout_gateway.server import GatewayConfig, create_app, running_server
    from rollout_gateway.v1 import (
        GatewayInterception,
        GatewayInterceptionConfig,
        gateway_synced_agent,
    )

    try:
        from fix_bug_v1 import FixBugHarnessConfig, FixBugTaskset
    except ImportError as e:
        raise DemoError(
            "the v1 example is not installed: pip install -e examples/fix_bug_v1"
        ) from e

    admin_token = secrets.token_urlsafe(32)
    async with contextlib.AsyncExitStack() as stack:
        try:
            if options.upstream:
                upstream, model = options.upstream.rstrip("/"), str(options.model)
            else:
                model_root = await stack.enter_async_context(
                    running_server(create_scripted_model_app())
                )
                upstream, model = f"{model_root}/v1", options.model or "scripted"
                print(f"scripted model  {upstream}", file=out)
            gateway_app = create_app(GatewayConfig(upstreams=[upstream], admin_token=admin_token))
            gateway_root = await stack.enter_async_context(running_server(gateway_app))
        except Exception as e:
            raise DemoError(f"could not start the servers: {e}") from e
        print(f"rollout gateway {gateway_root}  (upstream {upstream}, verifiers v1)", file=out)
        interception = await stack.enter_async_context(
            GatewayInterception(GatewayInterceptionConfig(tunnel="direct"), admin_token=admin_token)
        )
        config = vf.AgentConfig(
            model=model,
            client=vf.EvalClientConfig(base_url=f"{gateway_root}/v1"),
            harness=FixBugHarnessConfig(),
            runtime=vf.SubprocessConfig(),
            sampling=vf.SamplingConfig(
                temperature=options.temperature, max_tokens=options.max_tokens
            ),
        )
        agent = gateway_synced_agent(vf.Agent(config, interception=interception), interception)
        tasks = list(FixBugTaskset(vf.TasksetConfig(id="fix-bug-v1")))[: options.examples]
        gate = asyncio.Semaphore(options.concurrency)
        traces: list[Any] = []  # in the order they finish: what a timeout keeps

        async def one(task: Any) -> None:
            async with gate:
                trace = await agent.run(task)
            print(_row(task, trace, verbose=options.verbose), file=out)
            traces.append(trace)

        total = len(tasks) * options.rollouts_per_example
        timed_out = False
        async with agent:
            try:
                async with asyncio.timeout(options.timeout):
                    await asyncio.gather(
                        *(one(t) for t in tasks for _ in range(options.rollouts_per_example))
                    )
            except TimeoutError:
                timed_out = True
    return _report(options, traces, total, timed_out, out)


def _report(
    options: DemoOptions, traces: list[Any], total: int, timed_out: bool, out: TextIO
) -> int:
    """Write the finished traces, print the summary; the exit code."""
    run_dir = options.output or DEFAULT_OUTPUT_ROOT / f"demo-v1-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(run_dir) / "traces.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with Path(path).open("w") as f:
        for trace in traces:
            f.write(json.dumps(trace.model_dump(mode="json")) + "\n")
    failed = sum(1 for t in traces if not t.ok)
    mean = sum(t.reward for t in traces) / max(1, len(traces))
    print(
        f"{len(traces)} rollouts, {failed} failed, mean reward {mean:.2f}, "
        f"branches per rollout {[t.num_branches for t in traces]} -> {path}",
        file=out,
    )
    if timed_out:
        print(
            f"timed out after {options.timeout:g} s (--timeout): {len(traces)} of {total} "
            "rollouts finished; their traces are kept",
            file=out,
        )
        return EXIT_TIMEOUT
    return EXIT_OK if failed == 0 else EXIT_FAILED_ROLLOUTS


def _refuse_unsupported(options: DemoOptions) -> None:
    """The 0.3 demo's options this one cannot honour are refused, not ignored."""
    given = []
    if options.resume is not None:
        given.append("--resume (the v1 demo writes no metadata.json to resume from)")
    if options.isolation != DemoOptions().isolation:
        given.append("--isolation (v1's agents run on its subprocess runtime)")
    if given:
        raise DemoError(f"not available with verifiers 0.4: {'; '.join(given)}")


def _row(task: Any, trace: Any, *, verbose: bool = False) -> str:
    row = (
        f"{task.data.id:14} ok={trace.ok!s:5} reward={trace.reward:.2f} "
        f"turns={trace.num_turns} branches={trace.num_branches} stop={trace.stop_condition}"
    )
    if trace.errors:
        error = "; ".join(str(e) for e in trace.errors)
        row += f" error={error if verbose else (error.splitlines() or [''])[0][:160]}"
    return row


__all__ = ["run_v1_demo"]
