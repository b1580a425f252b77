"""What three gateways on one Redis cost, beside one gateway in memory, in one run.

Starts, each in its own process on loopback: the scripted model, one gateway in memory
(``memory``: the default backend), a ``redis-server`` (append-only file synced every
second, Redis's usual setting: ``--fsync always`` for every write), three gateways
on it (``rollout-gateway serve --redis``) and HAProxy balancing over them round robin,
without stickiness (``tests/support/local_cluster.py``, what the scale-out tests run).
Then, for each context size, rounds of ``--rollouts`` concurrent rollouts of ``--turns``
turns through each path, the paths taking turns round by round (``gateway_overhead.py``'s
load), so a drift of a shared machine weighs on each alike:

* ``memory``: straight to the memory gateway;
* ``redis-3``: through HAProxy to the three Redis gateways: each turn of a rollout lands
  on the next gateway, which catches up with the turns the others recorded;
* ``redis-3-uri``: through a second HAProxy over the same gateways, balancing by the
  path (``/v1/rollouts/{id}``): each rollout's requests on one gateway, the load spread
  over three processes as with ``redis-3``, but no catching up;
* ``memory-3-uri``: three memory gateways behind HAProxy balancing by the path: what
  spreading the load over three processes costs without Redis;
* ``redis-1``: straight to one of the Redis gateways (every turn on the gateway that
  holds the rollout: what the store costs without the catching up, in one process);
* ``base-redis-3`` (with ``--compare-source DIR``): ``redis-3`` with three gateways of
  another checkout's ``rollout_gateway`` (their own key prefix on the same Redis): the
  A/B of a change, side by side in the same run.

Figures: **CPU per turn per gateway** (the gateway processes' CPU over the turns they
served; the three summed on the balanced paths), Redis's and HAProxy's own CPU per turn
beside it, and latency p50 / p99. ``redis-3`` against ``memory`` is the issue's figure;
``memory-3-uri``, ``redis-1`` and ``redis-3-uri`` say what of it is spreading the load
over processes, what is the store (two Redis round trips a turn) and what is the
catching up.

Then the same with a **paced model** (``--model-latency-ms``, the scripted model sleeping
that long per completion, as a real model takes time): a second set of servers on it, and
``direct`` (straight to the model) and ``lb-only`` (HAProxy straight to the model) beside
the gateways: the **latency added** to a turn at p50 is each path's p50 minus direct's
(``lb-only``'s is the balancer's own hop), at the first context size.

Every figure is printed with its target (issue 26: CPU per turn per gateway at most 1.5x
the single memory gateway's; added latency p50 under 2 ms at 1k context with a paced
model) and the memory baseline measured in the same run. ``--quick`` (fewer turns per
cell, one paced round per path) runs in under 3 minutes on a 16-core host (5 minutes on
2 shared cores)::

    python benchmarks/scaleout.py --quick
    python benchmarks/scaleout.py --quick --compare-source ../main   # redis-3 vs main's
    python benchmarks/scaleout.py --contexts 1000,32000 --rollouts 64 --clients 4

Needs ``redis-server`` and ``haproxy`` (Debian packages) and the ``redis`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

from gateway_overhead import (
    ADMIN_TOKEN,
    RunResult,
    Target,
    _free_port,
    _one_round,
    _process,
    merge_run,
    rounds_for,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
from support.local_cluster import GatewayGroup, HAProxy, RedisServer  # noqa: E402

CLI = [sys.executable, "-m", "rollout_gateway.cli"]
#: Servers of one set, by name: what a path's CPU is read from.
GATEWAYS = ("gw0", "gw1", "gw2")
MEMORY_GATEWAYS = ("mem0", "mem1", "mem2")
#: The other checkout's Redis gateways (``--compare-source``).
BASE_GATEWAYS = ("base0", "base1", "base2")
#: HAProxy balancing by the path's first three parts (``/v1/rollouts/{id}``): each
#: rollout's requests, register included, on one gateway.
BY_ROLLOUT = "uri depth 3"


def servers(
    stack: contextlib.ExitStack,
    directory: Path,
    redis: RedisServer,
    latency_ms: float,
    source: Path | None = None,
) -> tuple[list[Target], dict[str, int], str]:
    """Start, on ``stack``: a scripted model (``latency_ms`` per completion), a memory
    gateway, three Redis gateways (a key prefix of their own) and HAProxy over them (and
    the same of ``source``'s gateways, when given).
    Returns the paths, every server's pid by name, and the model's root."""
    model_port = _free_port()
    model_root = f"http://127.0.0.1:{model_port}"
    model = [*CLI, "scripted-model", "--port", str(model_port), "--log-level", "warning",
             "--latency-ms", str(latency_ms)]  # fmt: skip
    pids = {"model": stack.enter_context(_process(model, f"{model_root}/v1/models"))}
    upstream = f"{model_root}/v1"
    common = ["--max-rollouts", "20000"]
    port = _free_port()
    memory = [*CLI, "serve", "--upstream", upstream, "--port", str(port), "--log-level",
              "warning", *common]  # fmt: skip
    env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    pids["memory"] = stack.enter_context(
        _process(memory, f"http://127.0.0.1:{port}/health", env=env)
    )
    prefix = f"bench{latency_ms:g}:"
    group = GatewayGroup(
        redis.url, upstream, len(GATEWAYS), directory / f"gateways-{latency_ms:g}",
        admin_token=ADMIN_TOKEN, extra_args=[*common, "--redis-prefix", prefix],
    )  # fmt: skip
    stack.enter_context(group)
    pids.update(zip(GATEWAYS, group.pids(), strict=True))
    lb = stack.enter_context(HAProxy(group.ports, directory / f"lb-{latency_ms:g}"))
    by_uri = stack.enter_context(
        HAProxy(group.ports, directory / f"lb-uri-{latency_ms:g}", balance=BY_ROLLOUT)
    )
    # Three memory gateways, each rollout's requests on one of them (by its path).
    memory_3 = GatewayGroup(
        None, upstream, len(GATEWAYS), directory / f"memory-{latency_ms:g}",
        admin_token=ADMIN_TOKEN, extra_args=common,
    )  # fmt: skip
    stack.enter_context(memory_3)
    pids.update(zip(MEMORY_GATEWAYS, memory_3.pids(), strict=True))
    memory_lb = stack.enter_context(
        HAProxy(memory_3.ports, directory / f"lb-mem-{latency_ms:g}", balance=BY_ROLLOUT)
    )
    pids["haproxy"], pids["haproxy-uri"] = lb.pid, by_uri.pid
    pids["haproxy-mem"], pids["redis"] = memory_lb.pid, redis.pid
    targets = [
        Target("memory", f"http://127.0.0.1:{port}", pids["memory"], gateway=True),
        Target("memory-3-uri", memory_lb.root, None, gateway=True),
        Target("redis-3", lb.root, None, gateway=True),
        Target("redis-3-uri", by_uri.root, None, gateway=True),
        Target("redis-1", group.roots()[0], pids["gw0"], gateway=True),
    ]
    if source is not None:
        targets.append(
            _base_gateways(stack, directory, redis, upstream, latency_ms, source, pids, common)
        )
    return targets, pids, model_root


def _base_gateways(
    stack: contextlib.ExitStack,
    directory: Path,
    redis: RedisServer,
    upstream: str,
    latency_ms: float,
    source: Path,
    pids: dict[str, int],
    common: list[str],
) -> Target:
    """Start ``source``'s three Redis gateways (a key prefix of their own) and HAProxy
    over them, on ``stack``; their pids go into ``pids``."""
    base = GatewayGroup(
        redis.url, upstream, len(BASE_GATEWAYS), directory / f"base-{latency_ms:g}",
        admin_token=ADMIN_TOKEN, source=source,
        extra_args=[*common, "--redis-prefix", f"base{latency_ms:g}:"],
    )  # fmt: skip
    stack.enter_context(base)
    pids.update(zip(BASE_GATEWAYS, base.pids(), strict=True))
    base_lb = stack.enter_context(HAProxy(base.ports, directory / f"lb-base-{latency_ms:g}"))
    pids["haproxy-base"] = base_lb.pid
    return Target("base-redis-3", base_lb.root, None, gateway=True)


def measure(
    args: argparse.Namespace,
    targets: list[Target],
    pids: dict[str, int],
    contexts: list[int],
    spread_s: float,
    min_turns: int,
) -> dict[tuple[int, str], RunResult]:
    """(context, path) -> the cell's figures over at least ``min_turns`` turns."""
    for target in targets:  # warm up every path (imports, connections, scripts loaded)
        asyncio.run(_one_round(target, pids, rollouts=4, turns=3, context_tokens=1000,
                               tool_chars=50))  # fmt: skip
    results: dict[tuple[int, str], RunResult] = {}
    for context in contexts:
        for _ in range(rounds_for(min_turns, args.rollouts, args.turns)):
            for target in targets:
                res = asyncio.run(
                    _one_round(
                        target, pids, rollouts=args.rollouts, turns=args.turns,
                        context_tokens=context, tool_chars=args.tool_output_chars,
                        clients=args.clients, start_spread_s=spread_s,
                    )
                )  # fmt: skip
                merge_run(results.setdefault((context, target.name), RunResult([], 0.0, {})), res)
    return results


def gateway_cpu_ms(path: str, res: RunResult) -> float:
    """CPU per turn of the gateway processes that served ``path``'s turns."""
    names = {
        "memory": ["memory"], "redis-1": ["gw0"], "memory-3-uri": list(MEMORY_GATEWAYS),
        "base-redis-3": list(BASE_GATEWAYS),
    }.get(path, list(GATEWAYS))  # fmt: skip
    return sum(res.cpu_s[n] for n in names) * 1000 / len(res.latencies_s)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns per cell")
    parser.add_argument("--contexts", type=_ints, default=[1000, 32000], help="context tokens")
    parser.add_argument("--rollouts", type=int, default=64, help="concurrent rollouts")
    parser.add_argument("--turns", type=int, default=40, help="turns per conversation")
    parser.add_argument(
        "--min-turns", type=int, default=7680, help="turns measured per cell (--quick: 2560)"
    )
    parser.add_argument(
        "--clients", type=int, default=1,
        help="load-generator processes per round (on a many-core host, e.g. 4)",
    )  # fmt: skip
    parser.add_argument("--tool-output-chars", type=int, default=200)
    parser.add_argument(
        "--model-latency-ms", type=float, default=500.0,
        help="the paced model's time per completion (0: no paced part; default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--fsync", choices=("everysec", "always"), default="everysec",
        help="Redis's appendfsync (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--compare-source", metavar="DIR", type=Path,
        help="also run redis-3 with another checkout's gateways (base-redis-3), e.g. main's",
    )  # fmt: skip
    return parser


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    """Run the benchmark and print its figures."""
    args = _parser().parse_args()
    if args.quick:
        args.min_turns = min(args.min_turns, 2560)
        args.turns = min(args.turns, 20)
    # A paced round takes turns x the model's latency whatever the host: fewer of them.
    args.paced_turns = args.min_turns // 4
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rg-scaleout-") as tmp:
        directory = Path(tmp)
        with RedisServer(directory / "redis", fsync=args.fsync) as redis:
            with contextlib.ExitStack() as stack:
                targets, pids, _ = servers(stack, directory, redis, 0.0, args.compare_source)
                fast = measure(args, targets, pids, args.contexts, 0.0, args.min_turns)
            paced: dict[tuple[int, str], RunResult] = {}
            if args.model_latency_ms > 0:
                with contextlib.ExitStack() as stack:
                    latency = args.model_latency_ms
                    targets, pids, model_root = servers(
                        stack, directory, redis, latency, args.compare_source
                    )
                    lb = stack.enter_context(HAProxy([int(model_root.rsplit(":", 1)[1])],
                                                     directory / "lb-model"))  # fmt: skip
                    targets = [
                        Target("direct", model_root, pids["model"]),
                        Target("lb-only", lb.root, lb.pid),
                        *targets,
                    ]
                    paced = measure(
                        args, targets, pids, args.contexts[:1], latency / 1000, args.paced_turns
                    )
    report(args, load_start, fast, paced)


#: A target's row: what, the target, the figure measured, whether it is met.
TargetRow = tuple[str, str, str, bool]
#: Which HAProxy's CPU a path's turns also cost.
BALANCER_OF = {
    "redis-3": "haproxy", "redis-3-uri": "haproxy-uri", "memory-3-uri": "haproxy-mem",
    "base-redis-3": "haproxy-base",
}  # fmt: skip


def report(
    args: argparse.Namespace,
    load_start: float,
    fast: dict[tuple[int, str], RunResult],
    paced: dict[tuple[int, str], RunResult],
) -> None:
    """Print the cells, the ratios to the memory gateway and the targets."""
    print(
        f"host load {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end on "
        f"{os.cpu_count()} CPUs; {args.rollouts} rollouts x {args.turns} turns per round, "
        f"tool output {args.tool_output_chars} chars; Redis appendfsync {args.fsync}"
    )
    _print_fast(fast)
    rows = _print_ratios(args, fast)
    if paced:
        rows.append(_print_paced(args, paced))
    width = max(len(r[0]) for r in rows)
    print(f"\ntargets (issue 26), this run:\n  {'':<{width}}  {'target':<9}{'measured':<48}met")
    for name, target, measured, met in rows:
        print(f"  {name:<{width}}  {target:<9}{measured:<48}{'yes' if met else 'NO'}")


def _print_fast(fast: dict[tuple[int, str], RunResult]) -> None:
    """The cells with the model answering at once: CPU per turn of each process kind."""
    print("\nmodel answering at once (CPU per turn; gateway = the gateways that served it)")
    head = f"{'context':>8}  {'path':<12}{'turns':>7}{'gateway CPU ms/turn':>21}"
    print(f"{head}{'redis':>8}{'haproxy':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for (context, path), res in fast.items():
        n = len(res.latencies_s)
        redis_ms = res.cpu_s["redis"] * 1000 / n if "redis" in path else 0.0
        balancer = BALANCER_OF.get(path)
        lb_ms = res.cpu_s[balancer] * 1000 / n if balancer else 0.0
        print(
            f"{context:>8}  {path:<12}{n:>7}{gateway_cpu_ms(path, res):21.3f}{redis_ms:8.3f}"
            f"{lb_ms:9.3f}{res.pct(0.5):9.2f}{res.pct(0.99):9.2f}"
        )


def _print_ratios(
    args: argparse.Namespace, fast: dict[tuple[int, str], RunResult]
) -> list[TargetRow]:
    """Each path's CPU per turn per gateway over the memory gateway's; the targets' rows."""
    rows: list[TargetRow] = []
    print("\nratios to the memory gateway (same run):")
    compared = ("base-redis-3",) if args.compare_source else ()
    for context in args.contexts:
        memory = gateway_cpu_ms("memory", fast[(context, "memory")])
        for path in ("redis-3", "redis-3-uri", "redis-1", "memory-3-uri", *compared):
            ratio = gateway_cpu_ms(path, fast[(context, path)]) / memory
            print(
                f"  CPU per turn per gateway, {path}/memory at {context} tokens: {ratio:.2f}x "
                f"(memory {memory:.3f} ms)"
            )
            if path == "redis-3":
                name = f"CPU/turn/gateway redis-3/memory, {context} tok"
                rows.append(
                    (name, "<= 1.5x", f"{ratio:.2f}x (memory {memory:.3f} ms)", ratio <= 1.5)
                )
        if compared:
            ab = gateway_cpu_ms("redis-3", fast[(context, "redis-3")]) / gateway_cpu_ms(
                "base-redis-3", fast[(context, "base-redis-3")]
            )
            print(f"  A/B: redis-3/base-redis-3 at {context} tokens: {ab:.2f}x")
    return rows


def _print_paced(args: argparse.Namespace, paced: dict[tuple[int, str], RunResult]) -> TargetRow:
    """The latency each path adds to a turn of a paced model; the target's row."""
    context = args.contexts[0]
    direct = paced[(context, "direct")].pct(0.5)
    print(
        f"\npaced model ({args.model_latency_ms:g} ms per completion) at {context} "
        f"tokens: latency added to a turn over direct's (p50 {direct:.2f} ms)"
    )
    print(f"  {'path':<12}{'turns':>7}{'p50 ms':>10}{'added p50':>11}{'p99 ms':>9}")
    for (_, path), res in paced.items():
        added = res.pct(0.5) - direct
        print(
            f"  {path:<12}{len(res.latencies_s):>7}{res.pct(0.5):10.2f}{added:11.2f}"
            f"{res.pct(0.99):9.2f}"
        )
    added_3 = paced[(context, "redis-3")].pct(0.5) - direct
    added_mem = paced[(context, "memory")].pct(0.5) - direct
    added_lb = paced[(context, "lb-only")].pct(0.5) - direct
    jitter = statistics.pstdev(paced[(context, "direct")].latencies_s) * 1000
    print(f"  (direct's own spread: stdev {jitter:.2f} ms)")
    return (
        f"added latency p50, redis-3 via HAProxy, {context} tok",
        "< 2 ms",
        f"{added_3:.2f} ms (memory {added_mem:.2f}, HAProxy alone {added_lb:.2f})",
        added_3 < 2.0,
    )


if __name__ == "__main__":
    main()
