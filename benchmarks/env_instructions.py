"""Instructions the env process executes, counted by valgrind: per rollout and per turn.

The env side of issue 33's targets, counted the way ``benchmarks/instructions.py``
counts the gateway's turn: the env process runs under valgrind's cachegrind
(``--tool=cachegrind --cache-sim=no --branch-sim=no``: instructions only), everything
else natively and uncounted: the scripted model (``rollout-gateway scripted-model``), a
plain ``rollout-gateway serve`` gateway in front of it, and the agents (each a process
the env starts in a local sandbox; valgrind does not follow a child's ``exec``, so an
agent's work is not the env's). One rollout at a time (concurrency 1), the same task
every rollout, the scripted model at temperature 0: the same bytes every run.

Two stacks, each in its own virtualenv (their verifiers exclude each other); the
benchmark measures the one its interpreter has (``--stack`` to say which):

* ``classic`` (verifiers 0.3, ``examples/fix_bug_env``: ``vf.CliAgentEnv`` with
  ``RolloutGatewayMixin`` in gateway mode, on local sandboxes): **instructions per
  rollout**. Two fresh env processes run at once, one doing ``N`` rollouts
  (``--rollouts``), the other ``2N``; ``(count(2N) - count(N)) / N`` is what a rollout
  costs the env (start-up, the first rollout's one-time work and shutdown cancel).
  With ``--compare-source DIR`` the same env script runs a second time with ``DIR``'s
  ``rollout_gateway`` first on its path (its mixin, its example env, its local
  sandboxes; the same verifiers): ``base``. The issue names "the earlier mixin";
  the base meant here is ``368ce21`` (``git worktree add --detach /tmp/env-base
  368ce21``), the commit issue 33 was filed at: the mixin as it stood when the target
  was set, and an older checkout that runs this same script unchanged on the same
  verifiers 0.3, so that only the package's code differs. verifiers 0.1.11's own
  experimental mixin cannot run it (another verifiers, no gateway mode of this
  protocol, no local sandboxes); ``benchmarks/burst_compare.py`` compares against it
  on fakes, in CPU time. ``--sandbox process`` runs the agents in
  ``benchmarks/process_sandbox.py``'s sandboxes instead of the package's local ones (the
  same code for both sides, through the mixin's ``sandbox_client`` seam): a real agent
  process each, waited for without polling, deleted without a scan of ``/proc``, so that
  a rollout's count follows the mixin's code and not the machine's timing or its
  number of processes, as the local sandboxes' does.
* ``v1`` (verifiers 0.4, ``examples/fix_bug_v1``, v1's subprocess runtime):
  **instructions per turn**, in two modes, the same v1 agent and tasks:
  ``gateway`` (:class:`rollout_gateway.v1.GatewayInterception`: the agent calls the
  gateway, the env registers, replays the recorded turns into v1's trace, unregisters)
  and ``v1`` (v1's own ``InterceptionServer`` in the env process serves every model
  call, relaying it to the scripted model). Per mode two fresh env processes run at
  once, the same ``--v1-rollouts`` rollouts of ``--turns-short`` and of
  ``--turns-long`` turns; ``(count(long) - count(short)) / (rollouts x (long - short))``
  is a turn's cost to the env. The task's prompt is padded to each ``--contexts``.

**Lifetimes equalised.** An env also works on timers (the local sandboxes' reaper once
a second, the gateway client's keep-alive), in proportion to how long it lives. Each
counted process reports when it is ready (imports done, env built), then waits for the
signal to start; after its rollouts it waits for SIGUSR2, which comes when it has lived
as long since ready as the longer of the pair plus a few seconds: that work weighs alike
in both and cancels. Counted processes run with ``PYTHONHASHSEED=0`` and one BLAS thread
(OpenBLAS's idle workers spin by the wall clock), on bytecode compiled beforehand. ::

    .ci-venv/bin/python benchmarks/env_instructions.py --quick --compare-source /tmp/env-base
    .ci-venv/bin/python benchmarks/env_instructions.py --compare-source /tmp/env-base \
        --sandbox process
    .ci-venv-v1/bin/python benchmarks/env_instructions.py --quick
    .ci-venv-v1/bin/python benchmarks/env_instructions.py --contexts 1024,32768

Targets (issue 33): classic at most 1.0x base per rollout; v1 gateway mode at most 0.3x
v1's own interception per turn. Needs ``valgrind``. Under valgrind the env runs some 50
times slower: a counted env starts in about a minute of CPU (verifiers' imports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import callgrind_layers
from callgrind_layers import SEPARATE_CALLERS

from rollout_gateway import child_processes

#: gateway_overhead's (its ``_process`` sends it to the gateway's ``/health``).
ADMIN_TOKEN = "benchmark-admin-token-0123456789"
#: Dict and set order, hence the work, the same in every counted process; one BLAS
#: thread (numpy comes with verifiers' imports: OpenBLAS's idle worker threads spin for
#: as long as the machine's timing lets them, 5-7 M instructions either way between the
#: two processes of a pair in a first run).
COUNTED_ENV = {
    "PYTHONHASHSEED": "0",
    "ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
#: What a counted env prints when it is ready, and when its rollouts are done.
READY, DONE = "ENV-READY", "ENV-DONE"
#: Seconds each env of a pair lives past the longer one's last rollout.
GRACE_S = 5.0
#: A counted env starts (verifiers' imports under valgrind) in minutes on a loaded machine;
#: under callgrind at load 18 on 2 cores one had not started after 15 minutes.
START_TIMEOUT_S = 2400.0
STACKS = ("classic", "v1")
V1_MODES = ("gateway", "v1")
#: The classic env's sandboxes: ``_sandbox_client``.
SANDBOXES = ("local", "process")


# -- the counted env process -----------------------------------------------------------------


async def _run_counted(args: argparse.Namespace) -> None:
    """The counted env: build it, say READY, wait for SIGUSR1, run the rollouts, say
    DONE, wait for SIGUSR2, tear down. What it did goes to ``--result`` as JSON. (Not
    SIGTERM: a counted classic env exited 143 on it, before this teardown.)"""
    loop = asyncio.get_running_loop()
    go, stop = asyncio.Event(), asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    loop.add_signal_handler(signal.SIGUSR2, stop.set)
    run = _classic_env if args.run_env == "classic" else _v1_env
    await run(args, go, stop)


def _say(line: str) -> None:
    print(line, flush=True)


async def _classic_env(args: argparse.Namespace, go: asyncio.Event, stop: asyncio.Event) -> None:
    """``fix_bug_env`` in gateway mode on local sandboxes, ``--count`` rollouts one after
    another of the dataset's first task (as ``rollout-gateway demo`` runs it)."""
    import verifiers as vf
    from openai import AsyncOpenAI

    from rollout_gateway.examples.fix_bug_env import env as fix_bug

    sandboxes = _sandbox_client(args)
    env = fix_bug.load_environment(
        num_examples=1, use_gateway=True, sandbox_backend="local", sandbox_client=sandboxes,
        gateway={"tunnel_provider": "direct", "admin_token": ADMIN_TOKEN},
        timeout_seconds=600.0,
    )  # fmt: skip
    client = vf.OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url=f"{args.url}/v1", api_key="benchmark")
    )
    row = env.get_dataset(n=1)[0]
    data = {k: row[k] for k in ("prompt", "answer", "info") if k in row}
    data["example_id"] = 0
    outcomes = []
    _say(READY)
    await go.wait()
    for _ in range(args.count):
        output = await env.run_rollout(
            dict(data), client, "scripted", {"temperature": 0.0, "max_tokens": 512},
            state_columns=["trajectory", "agent_polls"],
        )  # fmt: skip
        error = output.get("error")
        outcomes.append({"reward": output.get("reward"), "error": repr(error) if error else None,
                         "turns": len(output.get("trajectory") or []),
                         "polls": output.get("agent_polls")})  # fmt: skip
    Path(args.result).write_text(json.dumps(outcomes))
    _say(DONE)
    await stop.wait()
    await env._teardown()
    sandboxes.teardown()


def _sandbox_client(args: argparse.Namespace) -> Any:
    """The classic env's sandboxes (``--sandbox``): local sandboxes (the package's, of the
    checkout counted), or ``process_sandbox``'s, the same code for both checkouts."""
    if args.sandbox == "process":
        from process_sandbox import ProcessSandboxClient

        return ProcessSandboxClient()
    from rollout_gateway.local_sandbox import LocalSandboxClient

    return LocalSandboxClient(isolation=args.isolation)


async def _v1_env(args: argparse.Namespace, go: asyncio.Event, stop: asyncio.Event) -> None:
    """``fix_bug_v1``'s agent on v1's subprocess runtime: ``--count`` rollouts one after
    another of a ``--turns``-turn task padded to ``--context`` (``v1_interception_cpu``'s
    task and rollouts), through the gateway or v1's own interception (``--mode``)."""
    from v1_interception_cpu import _interception, _rollouts, _task

    task = _task(args.turns, args.context)
    async with _interception(args.mode) as interception:
        _say(READY)
        await go.wait()
        turns = await _rollouts(
            interception, f"{args.url}/v1", sync=args.mode == "gateway", task=task,
            rollouts=args.count, concurrency=1,
        )  # fmt: skip
        Path(args.result).write_text(json.dumps([{"turns": turns}]))
        _say(DONE)
        await stop.wait()


# -- running a pair of counted envs -------------------------------------------------------------


@dataclass
class CountedEnv:
    """One env process under cachegrind: its count file, result and log."""

    name: str
    cmd: list[str]
    directory: Path
    env: dict[str, str]
    cwd: str | None = None
    #: Under callgrind (``--profile``: each cost kept per chain of callers) instead.
    profile: bool = False

    def __post_init__(self) -> None:
        self.out = self.directory / f"{self.name}.cg"
        self.result = self.directory / f"{self.name}.json"
        self.log = self.directory / f"{self.name}.log"
        self.lines: list[str] = []
        self.ready = self.done = 0.0
        if self.profile:
            tool = ["--tool=callgrind", f"--separate-callers={SEPARATE_CALLERS}",
                    f"--callgrind-out-file={self.out}"]  # fmt: skip
        else:
            tool = ["--tool=cachegrind", "--cache-sim=no", "--branch-sim=no",
                    f"--cachegrind-out-file={self.out}"]  # fmt: skip
        valgrind = ["valgrind", "-q", *tool]
        with open(self.log, "wb") as log:
            # Its own group, dead with this process (set before valgrind's exec).
            self.proc = child_processes.spawn(
                [*valgrind, *self.cmd, "--result", str(self.result)],
                stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, **self.env}, cwd=self.cwd,
            )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line == READY:
                self.ready = time.monotonic()
            elif line == DONE:
                self.done = time.monotonic()
            self.lines.append(line)

    def wait_for(self, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not (self.ready if what == READY else self.done):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text()[-3000:] + "\n".join(self.lines[-20:])
                raise RuntimeError(f"{self.name}: no {what} (exit {self.proc.returncode}): {tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGUSR2 (its teardown, then valgrind writes its file as it exits); SIGTERM, then
        SIGKILL, to its own process group if it does not exit."""
        for sig, wait in ((signal.SIGUSR2, 300.0), (signal.SIGTERM, 60.0), (signal.SIGKILL, 60.0)):
            if self.proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGUSR2:
                    os.kill(self.proc.pid, sig)
                else:
                    os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)

    def instructions(self) -> int:
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.log}")
        for line in self.out.read_text().splitlines():
            if line.startswith("summary:"):
                return int(line.split()[1])
        raise ValueError(f"{self.out}: no summary line")

    def outcomes(self) -> list[dict[str, Any]]:
        return list(json.loads(self.result.read_text()))


def run_pair(pair: list[CountedEnv], timeout: float) -> list[int]:
    """The envs (a pair, or pairs) started together, each stopped once it lived as long
    since ready as the longest one needed, plus :data:`GRACE_S`; their counts."""
    try:
        for env in pair:
            env.wait_for(READY, START_TIMEOUT_S)
        for env in pair:
            os.kill(env.proc.pid, signal.SIGUSR1)
        for env in pair:
            env.wait_for(DONE, timeout)
        lifetime = GRACE_S + max(env.done - env.ready for env in pair)
        for env in sorted(pair, key=lambda e: e.ready):
            time.sleep(max(0.0, env.ready + lifetime - time.monotonic()))
            env.stop()
    finally:
        for env in pair:
            env.stop()
    return [env.instructions() for env in pair]


def _counted_cmd(args: argparse.Namespace, stack: str, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--run-env", stack,
            "--url", args.url, "--isolation", args.isolation, "--sandbox", args.sandbox,
            *extra]  # fmt: skip


def _path_env(source: str | None) -> dict[str, str]:
    """A counted env's environment: ``source``'s package first on its path, if given."""
    first = [source] if source else []
    path = os.pathsep.join([*first, str(Path(__file__).resolve().parent)])
    return {**COUNTED_ENV, "PYTHONPATH": path}


def measure_classic(args: argparse.Namespace, directory: Path) -> dict[str, float]:
    """Instructions per rollout of each side (``ours``, and ``base`` with
    ``--compare-source``): N against 2N rollouts. Every process of both sides runs at
    once (and lives as long), so both sides meet the same machine: part of a rollout's
    cost follows it (the local sandboxes' scan of ``/proc`` when one is deleted)."""
    sides = [("ours", None)] + ([("base", args.compare_source)] if args.compare_source else [])
    envs = []
    for side, source in sides:
        where = directory / side
        where.mkdir(parents=True)
        for count in (args.rollouts, 2 * args.rollouts):
            cmd = _counted_cmd(args, "classic", "--count", str(count))
            envs.append(CountedEnv(f"{side}-{count}", cmd, where, _path_env(source), cwd=source))
    counts = run_pair(envs, args.timeout)
    figures = {}
    for index, (side, _) in enumerate(sides):
        for env in envs[2 * index : 2 * index + 2]:
            _check_classic(env)
        short, long = counts[2 * index : 2 * index + 2]
        figures[side] = (long - short) / args.rollouts
        per = figures[side] / 1e6
        polls = [[o["polls"] for o in env.outcomes()] for env in envs[2 * index : 2 * index + 2]]
        print(f"  {side}: {short:,} instructions ({args.rollouts} rollouts), {long:,} "
              f"({2 * args.rollouts}): {per:.2f} M per rollout; the agent's sandbox "
              f"asked {polls} times a rollout", flush=True)  # fmt: skip
    return figures


def _check_classic(env: CountedEnv) -> None:
    """Every rollout passed its test, with no error: failing rollouts are not measured."""
    bad = [o for o in env.outcomes() if o["error"] or o["reward"] != 1.0]
    if bad:
        raise RuntimeError(f"{env.name}: rollouts failed: {bad} (see {env.log})")


def measure_v1(args: argparse.Namespace, directory: Path) -> dict[tuple[int, str], float]:
    """Instructions per turn of each mode at each context: short against long tasks."""
    figures = {}
    for context in args.contexts:
        for mode in args.modes:
            where = directory / f"{mode}-{context}"
            where.mkdir(parents=True)
            url = args.url if mode == "gateway" else args.model_url
            pair = [
                CountedEnv(
                    f"{mode}-{context}-{turns}t",
                    _counted_cmd(
                        argparse.Namespace(**{**vars(args), "url": url}),
                        "v1",
                        "--count",
                        str(args.v1_rollouts),
                        "--turns",
                        str(turns),
                        "--context",
                        str(context),
                        "--mode",
                        mode,
                    ),
                    where,
                    _path_env(None),
                    profile=args.profile,
                )  # fmt: skip
                for turns in (args.turns_short, args.turns_long)
            ]
            short, long = run_pair(pair, args.timeout)
            (a,), (b,) = (env.outcomes() for env in pair)
            expected = [args.v1_rollouts * t for t in (args.turns_short, args.turns_long)]
            if [a["turns"], b["turns"]] != expected:
                raise RuntimeError(f"{mode} {context}: turns {a['turns']}, {b['turns']} "
                                   f"(expected {expected})")  # fmt: skip
            per_turn = (long - short) / (b["turns"] - a["turns"])
            figures[(context, mode)] = per_turn
            if args.profile:
                print_profile(pair, b["turns"] - a["turns"], f"  {mode} {context}")
            print(f"  {mode:8} {context:>6}: {short:,} ({a['turns']} turns), {long:,} "
                  f"({b['turns']}): {per_turn / 1e6:.3f} M per turn", flush=True)  # fmt: skip
    return figures


def print_profile(pair: list[CountedEnv], turns: int, title: str) -> None:
    """A profiled pair's marginal instructions per turn by layer (``callgrind_layers``:
    the garbage collector, JSON, the event loop, the interpreter) and by the library
    whose code executed them (pydantic's core, the interpreter, libc, ...)."""
    short, long = pair[0].out, pair[1].out
    layers = callgrind_layers.marginal(long, short, turns)
    callgrind_layers.print_shares(layers, f"{title}, per turn by layer")
    by_object: dict[str, float] = {}
    for path, sign in ((long, 1), (short, -1)):
        for (_, obj), ir in callgrind_layers.self_costs(path)[0].items():
            name = Path(obj).name.split(".cpython")[0] or "?"
            by_object[name] = by_object.get(name, 0.0) + sign * ir / turns
    top = dict(sorted(by_object.items(), key=lambda kv: -kv[1])[:8])
    callgrind_layers.print_shares(top, f"{title}, per turn by library (largest 8)")


def print_classic(figures: dict[str, float]) -> None:
    print("\nclassic env process, marginal instructions per rollout (M):")
    for side, value in figures.items():
        print(f"  {side:<6}{value / 1e6:10.2f}")
    if "base" in figures:
        ratio = figures["ours"] / figures["base"]
        print(f"  ours / base: {ratio:.3f}x ({figures['ours'] / 1e6:.2f} / "
              f"{figures['base'] / 1e6:.2f} M)  target <= 1.0x")  # fmt: skip


def print_v1(figures: dict[tuple[int, str], float], contexts: list[int]) -> None:
    print("\nv1 env process, marginal instructions per turn (M):")
    print(f"  {'context':>8}{'gateway':>10}{'v1':>10}{'gateway / v1':>16}")
    for context in contexts:
        gateway, own = (figures.get((context, mode), float("nan")) for mode in V1_MODES)
        print(f"  {context:>8}{gateway / 1e6:10.3f}{own / 1e6:10.3f}"
              f"{gateway / own:15.3f}x  target <= 0.3x")  # fmt: skip


# -- the uncounted processes, the command line ----------------------------------------------------


def _processes() -> int:
    """Processes on the machine: a local sandbox's deletion scans each one's ``/proc``
    entry (``local_sandbox.processes.marked_pids``), about 0.1 M instructions each."""
    return sum(name.isdigit() for name in os.listdir("/proc"))


def _installed_stack() -> str:
    import importlib.metadata as metadata

    major_minor = tuple(int(x) for x in metadata.version("verifiers").split(".")[:2])
    return "v1" if major_minor >= (0, 4) else "classic"


def _precompile(source: str | None) -> None:
    """Bytecode compiled once beforehand, so that no counted process compiles it."""
    import rollout_gateway

    trees = [Path(rollout_gateway.__file__).parent, Path(__file__).resolve().parent]
    if source:
        trees.append(Path(source) / "rollout_gateway")
    for tree in trees:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree)], check=True)


@contextlib.contextmanager
def _uncounted(args: argparse.Namespace) -> Any:
    """The scripted model and a gateway in front of it, each in its own process group,
    stopped by their PIDs at the end."""
    from gateway_overhead import _free_port, _process

    model_port, gateway_port = _free_port(), _free_port()
    args.model_url = f"http://127.0.0.1:{model_port}"
    args.url = f"http://127.0.0.1:{gateway_port}"
    cli = [sys.executable, "-m", "rollout_gateway.cli"]
    os.environ["ROLLOUT_GATEWAY_ADMIN_TOKEN"] = ADMIN_TOKEN  # the gateway reads it
    model = [*cli, "scripted-model", "--port", str(model_port), "--log-level", "warning"]
    gateway = [*cli, "serve", "--upstream", f"{args.model_url}/v1", "--port",
               str(gateway_port), "--log-level", "warning"]  # fmt: skip
    with (
        _process(model, f"{args.model_url}/v1/models"),
        _process(gateway, f"{args.url}/health"),
    ):
        yield


def _modes(text: str) -> list[str]:
    modes = [x for x in text.split(",") if x]
    if not modes or set(modes) - set(V1_MODES):
        raise argparse.ArgumentTypeError(f"of {', '.join(V1_MODES)}")
    return modes


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true",
        help="classic: 1 vs 2 rollouts; v1: 1 rollout of 2 vs 4 turns at 1k")  # fmt: skip
    add("--stack", choices=STACKS, help="default: the installed verifiers' generation")
    add("--rollouts", type=int, default=2, help="classic: N rollouts (and 2N)")
    add("--compare-source", metavar="DIR",
        help="classic: also count the env with DIR's rollout_gateway (e.g. 368ce21)")  # fmt: skip
    add("--contexts", type=_ints, default=[1024], help="v1: prompt sizes (default 1024)")
    add("--v1-rollouts", type=int, default=2, help="v1: rollouts per process")
    add("--turns-short", type=int, default=2, help="v1: turns per rollout, short tasks")
    add("--turns-long", type=int, default=6, help="v1: turns per rollout, long tasks")
    add("--isolation", default="process-group",
        help="the local sandboxes' isolation (classic; default process-group)")  # fmt: skip
    add("--sandbox", choices=SANDBOXES, default="local",
        help="classic: the package's local sandboxes (default), or process: "
        "benchmarks/process_sandbox.py, whose cost does not follow the machine")  # fmt: skip
    add("--timeout", type=float, default=1800.0, help="seconds a pair's rollouts may take")
    add("--keep", type=Path, metavar="DIR", help="keep the count files and logs in DIR")
    add("--profile", action="store_true",
        help="v1: callgrind instead, each mode's instructions per turn by layer "
        "(benchmarks/callgrind_layers.py; on Python 3.11 the C layers only)")  # fmt: skip
    add("--modes", type=_modes, default=list(V1_MODES), help="v1: gateway, v1 (default both)")
    for hidden in ("--run-env", "--url", "--result", "--mode"):
        add(hidden, help=argparse.SUPPRESS)
    for hidden in ("--count", "--turns", "--context"):
        add(hidden, type=int, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    """Run the benchmark (or, with the hidden ``--run-env``, be a counted env)."""
    parser = _parser()
    args = parser.parse_args()
    if args.run_env:
        import rollout_gateway

        print(f"rollout_gateway from {rollout_gateway.__file__}", file=sys.stderr, flush=True)
        asyncio.run(_run_counted(args))
        return
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (Debian: apt-get install valgrind)")
    args.stack = args.stack or _installed_stack()
    if args.compare_source:
        if args.stack != "classic":
            parser.error("--compare-source is for the classic stack")
        args.compare_source = os.path.abspath(args.compare_source)
    if args.quick:
        args.rollouts, args.v1_rollouts, args.turns_short, args.turns_long = 1, 1, 2, 4
        args.contexts = [1024]
    _precompile(args.compare_source)
    started, load, procs = time.perf_counter(), os.getloadavg()[0], _processes()
    with _uncounted(args), contextlib.ExitStack() as stack:
        directory = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        print(f"{args.stack}: counting the env process (cachegrind)", flush=True)
        if args.stack == "classic":
            classic = measure_classic(args, directory)
        else:
            v1 = measure_v1(args, directory)
    print(f"\nload {load:.1f} at start, {os.getloadavg()[0]:.1f} at end on {os.cpu_count()} "
          f"CPUs; processes on the machine {procs} at start, {_processes()} at end; "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    if args.stack == "classic":
        if args.compare_source:
            print(f"base: the env with rollout_gateway from {args.compare_source}")
        print_classic(classic)
    else:
        print(f"{args.v1_rollouts} rollout(s) of {args.turns_short} vs {args.turns_long} turns")
        print_v1(v1, args.contexts)


if __name__ == "__main__":
    main()
