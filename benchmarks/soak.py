"""The chaos soak (issue 34): a whole local deployment under every fault at once, for long
enough that leaks and drifts show, and a ledger that accounts for every rollout.

Each part is started and stopped by this script, each in its own process group on free
loopback ports (``tests/support/local_cluster.py``), and only those groups are signalled:

* the **scripted model** (``rollout-gateway scripted-model``) with a latency
  (``--model-latency-ms``) and its own faults: 500s, slow answers, connections dropped
  mid-answer (``--fault-*``), and its **ledger** of every completion served;
* **three gateways on Redis** behind **HAProxy** (readiness ``/health``), and **one
  gateway on SQLite** whose state directory lives on a small tmpfs (so it can be filled);
* **env processes** (``benchmarks/soak_env.py``): the example env (verifiers 0.3) on
  contained local sandboxes at a fixed concurrency, two through HAProxy and one on the
  SQLite gateway; a share of their rollouts runs hostile agents (memory hog, fork bomb,
  retry storm after a refusal, oversized bodies, an agent that never exits);
* a **canary** making one turn a second through HAProxy (the turn latency curve).

**Chaos on a schedule** drawn from ``--seed`` (printed; the same seed, the same
schedule): ``kill -9`` of a Redis gateway every ``--gateway-kill-every`` seconds (restarted
a second later, as a supervisor would), Redis restarted once, an env process killed with
``kill -9`` and started again with ``--resume``, the model down for ``--outage-s`` (30 s),
the SQLite gateway's state directory filled up for 20 s and freed, and the SQLite gateway
killed and restarted once.

Every 10 s: RSS, open fds, threads and CPU time of every process, the machine's busy
CPU; live sandboxes, their cgroups,
loop mounts and directories; SQLite file and WAL sizes; Redis memory and keys. At the end
(envs drained, chaos stopped): the ledger check and the end-state counts (nothing may be
left behind), ``samples.csv``, ``canary.csv``, ``events.json``, ``report.json`` and
``curves.png`` (matplotlib, if installed: ``pip install matplotlib``) in ``--out``, and
the slopes of the memory and fd curves printed (target: under 1 % per hour).

    python benchmarks/soak.py --quick            # 3 minutes (4.5 with start and drain)
    python benchmarks/soak.py --minutes 30 --seed 7

Needs ``redis-server``, ``haproxy``, the ``redis`` extra, root (tmpfs for the SQLite fill)
and a host whose local sandboxes contain an agent (``rollout-gateway demo --help`` says).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_report import (  # noqa: E402
    cpu_by_part,
    draw,
    latency_by_minute,
    latency_drift,
    ledger_check,
    read_lines,
    slopes,
    write_csv,
)
from support.local_cluster import (  # noqa: E402
    GatewayGroup,
    HAProxy,
    RedisServer,
    _Child,
    _wait_port,
    free_port,
)

ADMIN_TOKEN = "soak-admin-" + secrets.token_hex(16)
SAMPLE_EVERY_S = 10.0


# -- the parts ------------------------------------------------------------------------------------


class Model:
    """The scripted model on a fixed port (the gateways keep its URL across outages)."""

    def __init__(self, directory: Path, args: argparse.Namespace) -> None:
        self.directory = directory
        self.port = free_port()
        self.args = args
        self.starts = 0
        self.child: _Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        a = self.args
        cmd = [
            sys.executable, "-m", "rollout_gateway.cli", "scripted-model",
            "--port", str(self.port), "--latency-ms", str(a.model_latency_ms),
            "--ledger", str(self.directory / "model-ledger.jsonl"),
            "--fault-error-rate", str(a.fault_error_rate),
            "--fault-slow-rate", str(a.fault_slow_rate), "--fault-slow-s", str(a.fault_slow_s),
            "--fault-drop-rate", str(a.fault_drop_rate),
            "--fault-seed", str(a.seed * 1000 + self.starts),
        ]  # fmt: skip
        self.starts += 1
        self.child = _Child(cmd, self.directory / "model.log")
        self.child.start()
        _wait_port(self.port, self.child.proc, "scripted-model", self.child.log)  # type: ignore[arg-type]

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


@dataclass
class EnvProcess:
    """One ``soak_env.py`` process (restartable with ``--resume``)."""

    name: str
    gateway: str
    directory: Path
    args: argparse.Namespace
    child: _Child | None = None
    starts: int = 0
    #: ``None``: a classic env (``soak_env.py``, this interpreter); else the interpreter
    #: of the v1 stack running ``soak_env_v1.py``.
    v1_python: str | None = None

    @property
    def journal(self) -> Path:
        return self.directory / f"env-{self.name}.jsonl"

    @property
    def sandbox_root(self) -> Path:
        return self.directory / "sandboxes" / self.name

    def command(self) -> list[str]:
        a = self.args
        common = [
            "--gateway", self.gateway, "--name", self.name, "--journal", str(self.journal),
            "--sandbox-root", str(self.sandbox_root), "--concurrency", str(a.concurrency),
            "--drain-s", str(a.drain_s), "--hostile-share", str(a.hostile_share),
            "--agent-timeout", str(a.agent_timeout), "--seed", str(a.seed),
        ]  # fmt: skip
        if self.v1_python is not None:
            return [self.v1_python, str(Path(__file__).with_name("soak_env_v1.py")), *common]
        return [sys.executable, str(Path(__file__).with_name("soak_env.py")), *common]

    def start(self) -> None:
        cmd = self.command()
        if self.starts:
            cmd.append("--resume")
        self.starts += 1
        self.child = _Child(
            cmd,
            self.directory / f"env-{self.name}.log",
            env={"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN},
        )
        self.child.start()

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()

    def terminate(self) -> None:
        """SIGTERM: it starts no new rollout and finishes those running."""
        if self.child is not None and self.child.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.child.proc.terminate()

    def wait_resumed(self, deadline: float) -> None:
        """After a restart, wait (until ``deadline``, monotonic) for the new process to
        journal what the killed one left (its ``resumed`` line): a SIGTERM during its
        start-up (seconds of imports on a loaded machine) would end it before that."""
        while time.monotonic() < deadline:
            lines = read_lines(self.journal)
            if sum(1 for x in lines if x.get("event") == "resumed") >= self.starts - 1:
                return
            if self.child is None or not self.child.running():
                return
            time.sleep(0.2)

    def wait(self, deadline: float) -> int | None:
        """Its exit code once it has drained (``kill -9`` at ``deadline``, monotonic)."""
        if self.child is None or self.child.proc is None:
            return None
        try:
            return self.child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.child.kill()
            return None


class SqliteVolume:
    """A small tmpfs for the SQLite gateway's state directory (so it can be filled up)."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        self.size_mb = size_mb
        self.mounted = False

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        options = f"size={self.size_mb}m,mode=0700"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(self.path)],
            capture_output=True, text=True,
        )  # fmt: skip
        self.mounted = done.returncode == 0
        if not self.mounted:
            print(f"(no tmpfs for the SQLite state: {done.stderr.strip()}; the fill-up is skipped)")

    def fill(self) -> int:
        """Write a file until the volume is full; its size."""
        written = 0
        with contextlib.suppress(OSError), open(self.path / "filler", "wb") as out:
            chunk = b"\0" * (1 << 20)
            while True:
                out.write(chunk)
                out.flush()
                written += len(chunk)
        return written

    def free(self) -> None:
        (self.path / "filler").unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Soak:
    """Every part, the chaos, the samples."""

    args: argparse.Namespace
    out: Path
    started: float = field(default_factory=time.monotonic)
    events: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    canary: list[dict[str, Any]] = field(default_factory=list)
    health: list[dict[str, Any]] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.started

    def event(self, what: str, **detail: Any) -> None:
        entry = {"t": round(self.now(), 1), "what": what, **detail}
        with self.lock:
            self.events.append(entry)
        print(f"[{entry['t']:7.1f}s] {what} {detail if detail else ''}", flush=True)

    # -- start and stop -------------------------------------------------------------------------

    def start(self) -> None:
        a, out = self.args, self.out
        self.model = Model(out, a)
        self.model.start()
        self.redis = RedisServer(out / "redis", fsync="everysec").start()
        self.gateways = GatewayGroup(
            self.redis.url, self.model.url, 3, out / "gateways", admin_token=ADMIN_TOKEN,
        ).start()  # fmt: skip
        self.lb = HAProxy(self.gateways.ports, out / "haproxy").start()
        self.volume = SqliteVolume(out / "sqlite-volume", a.sqlite_volume_mb)
        self.volume.mount()
        self.sqlite_dir = self.volume.path / "state"
        self.sqlite = GatewayGroup(
            None, self.model.url, 1, out / "sqlite-gateway", admin_token=ADMIN_TOKEN,
            extra_args=["--state-dir", str(self.sqlite_dir)],
        ).start()  # fmt: skip
        self.envs = [EnvProcess(f"redis{i}", self.lb.root, out, a) for i in range(a.redis_envs)] + [
            EnvProcess(f"sqlite{i}", self.sqlite.roots()[0], out, a) for i in range(a.sqlite_envs)
        ]
        v1_python = v1_interpreter(a.v1_python)
        if v1_python is None or a.v1_envs == 0:
            why = "--v1-envs 0" if a.v1_envs == 0 else "no v1 interpreter"
            print(f"soak: no v1 env process ({why}; --v1-python PATH: rollout-gateway[v1])")
        else:
            self.envs += [
                EnvProcess(f"v1_{i}", self.lb.root, out, a, v1_python=v1_python)
                for i in range(a.v1_envs)
            ]
        for env in self.envs:
            env.start()
        self.event("started", model=self.model.url, lb=self.lb.root, envs=len(self.envs))

    def stop_servers(self) -> None:
        for part in ("lb", "gateways", "sqlite", "redis", "model"):
            with contextlib.suppress(Exception):
                getattr(self, part).stop()
        self.volume.unmount()

    # -- chaos ------------------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str, Callable[[], None]]]:
        """The chaos, drawn from the seed: (second of the run, name, action)."""
        a = self.args
        rng = random.Random(a.seed)
        total = a.minutes * 60
        plan: list[tuple[float, str, Callable[[], None]]] = []
        t = a.gateway_kill_every * rng.uniform(0.5, 1.0)
        while t < total - 45:
            index = rng.randrange(3)
            plan.append((t, f"kill -9 gateway{index}", lambda i=index: self.kill_gateway(i)))
            t += a.gateway_kill_every * rng.uniform(0.8, 1.2)
        for share, name, action in (
            (0.25, "kill -9 env redis0, resume", self.kill_env),
            (0.38, "restart redis", self.restart_redis),
            (0.50, f"model outage {a.outage_s:.0f} s", self.outage),
            (0.68, "fill the SQLite state volume", self.fill_sqlite),
            (0.80, "kill -9 the SQLite gateway", self.kill_sqlite_gateway),
        ):
            plan.append((total * share + rng.uniform(-5, 5), name, action))
        v1 = next((env for env in self.envs if env.v1_python is not None), None)
        if v1 is not None:  # drawn last: the schedule above is the same with or without it
            at = total * 0.58 + rng.uniform(-5, 5)
            plan.append((at, f"kill -9 env {v1.name}, resume", lambda: self.kill_env(v1)))
        return sorted(plan, key=lambda p: p[0])

    def chaos(self) -> None:
        for at, name, action in self.schedule():
            if self.stopping.wait(max(0.0, at - self.now())):
                return
            self.event(name)
            try:
                action()
            except Exception as exc:  # the soak reports it and goes on
                self.event(f"chaos step failed: {name}", error=repr(exc))

    def kill_gateway(self, index: int) -> None:
        self.gateways.kill(index)
        time.sleep(1.0)
        self.gateways.start_one(index)
        self.event(f"gateway{index} restarted")

    def kill_sqlite_gateway(self) -> None:
        self.sqlite.kill(0)
        time.sleep(1.0)
        self.sqlite.start_one(0)
        self.event("SQLite gateway restarted")

    def restart_redis(self) -> None:
        self.redis.kill()
        time.sleep(2.0)
        self.redis.restart()
        self.event("redis back")

    def kill_env(self, env: EnvProcess | None = None) -> None:
        env = env or self.envs[0]
        env.kill()
        time.sleep(2.0)
        env.start()
        self.event(f"env {env.name} resumed")

    def outage(self) -> None:
        self.model.kill()
        time.sleep(self.args.outage_s)
        self.model.start()
        self.event("model back")

    def fill_sqlite(self) -> None:
        if not self.volume.mounted:
            return
        written = self.volume.fill()
        self.event("SQLite volume full", filler_mb=written >> 20)
        time.sleep(20)
        self.volume.free()
        self.event("SQLite volume freed")

    # -- canary -----------------------------------------------------------------------------------

    def run_canary(self) -> None:
        """One turn a second through HAProxy, each rollout 20 turns (then a new one)."""
        with httpx.Client(base_url=self.lb.root, timeout=30) as client:
            canary = Canary(client)
            while not self.stopping.wait(1.0):
                try:
                    status, ms = canary.turn()
                except httpx.HTTPError as exc:
                    status, ms = 0, 0.0
                    canary.key = ""
                    self.canary.append({"t": round(self.now(), 2), "error": type(exc).__name__})
                if status:
                    self.canary.append(
                        {"t": round(self.now(), 2), "ms": round(ms, 2), "status": status}
                    )
            canary.close(final=True)

    # -- health ---------------------------------------------------------------------------------

    def run_health_watch(self) -> None:
        """Each gateway's ``/health`` every second (no token: what HAProxy sees); each
        change of its status or reasons is kept (what a failure looks like in it)."""
        last: dict[str, tuple[int, tuple[str, ...]]] = {}
        with httpx.Client(timeout=2) as client:
            while not self.stopping.wait(1.0):
                roots = [*self.gateways.roots(), *self.sqlite.roots()]
                for name, root in zip(
                    ["gateway0", "gateway1", "gateway2", "sqlite"], roots, strict=True
                ):
                    try:
                        answer = client.get(f"{root}/health")
                        state = (answer.status_code, tuple(answer.json().get("reasons", ())))
                    except (httpx.HTTPError, ValueError):
                        state = (0, ("no answer",))
                    if last.get(name) != state:
                        last[name] = state
                        change = {"t": round(self.now(), 1), "gateway": name, "status": state[0]}
                        self.health.append({**change, "reasons": list(state[1])})

    # -- samples ----------------------------------------------------------------------------------

    def processes(self) -> dict[str, int]:
        """role -> pid of every process the soak runs now."""
        out: dict[str, int] = {}
        with contextlib.suppress(Exception):
            out["model"] = self.model.child.pid  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            out["redis"] = self.redis.pid
        with contextlib.suppress(Exception):
            out["haproxy"] = self.lb.pid
        for i, child in enumerate(self.gateways._children):
            if child is not None and child.running():
                out[f"gateway{i}"] = child.pid
        for child in self.sqlite._children:
            if child is not None and child.running():
                out["sqlite_gateway"] = child.pid
        for env in self.envs:
            if env.child is not None and env.child.running():
                out[f"env_{env.name}"] = env.child.pid
        return out

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t": round(self.now(), 1), "machine_cpu_s": machine_busy_cpu_s()}
        for role, pid in self.processes().items():
            numbers = proc_numbers(pid)
            for name, value in numbers.items():
                row[f"{role}.{pid}.{name}"] = value
        roots = [env.sandbox_root for env in self.envs]
        dirs = [
            p
            for root in roots
            if root.exists()
            for p in root.iterdir()
            if not p.name.startswith(".")
        ]
        row["sandbox_dirs"] = len(dirs)
        row["sandboxes"] = sum(1 for p in dirs if p.name.startswith("local-"))
        names = {p.name for p in dirs}
        row["cgroups"] = count_cgroups(names)
        row["loop_mounts"] = count_mounts([str(r) for r in roots])
        row["sqlite_db_mb"] = file_mb(self.sqlite_dir / "state.db")
        row["sqlite_wal_mb"] = file_mb(self.sqlite_dir / "state.db-wal")
        row.update(redis_numbers(self.redis.port))
        running = 0
        for env in self.envs:
            lines = read_lines(env.journal)
            running += sum(1 for x in lines if x.get("event") == "start") - sum(
                1 for x in lines if x.get("event") in ("end", "interrupted")
            )
        row["rollouts_running"] = running
        return row

    def run_sampler(self) -> None:
        while True:
            row = self.sample()
            with self.lock:
                self.rows.append(row)
            if self.stopping.wait(SAMPLE_EVERY_S):
                return

    # -- the end ----------------------------------------------------------------------------------

    def end_state(self) -> dict[str, Any]:
        """What is left once every env has drained (all must be 0)."""
        roots = [env.sandbox_root for env in self.envs]
        ids = sandbox_ids_of(self.out)
        left = [p.name for root in roots if root.exists() for p in root.iterdir()]
        counts = {
            "sandbox_dirs": len(left),
            "cgroups": count_cgroups(ids),
            "loop_mounts": count_mounts([str(r) for r in roots]),
            "agent_processes": count_agent_processes(ids),
        }
        registered = {}
        for root in [*self.gateways.roots(), *self.sqlite.roots()]:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                registered[root] = (
                    httpx.get(f"{root}/health", timeout=10).json().get("active_rollouts")
                )
        counts["registered_rollouts_redis"] = redis_rollout_keys(self.redis.port)
        counts["registered_rollouts_per_gateway"] = registered
        return counts


class Canary:
    """A client making one-turn-at-a-time rollouts (the latency curve)."""

    BODY = {
        "model": "scripted",
        "messages": [{"role": "user", "content": '<script>[{"say": "ok"}]</script>'}],
    }

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        self.rollout, self.key, self.turns = "", "", 0
        #: Rollouts whose unregistration failed (a gateway down, HAProxy without one):
        #: tried again at each close, and at the end until they go.
        self.pending: list[str] = []

    def turn(self) -> tuple[int, float]:
        """One turn (a new rollout first when needed): its status and milliseconds; status
        0 when no rollout could be registered."""
        if not self.key or self.turns >= 20:
            self.close()
            self.rollout = f"canary-{secrets.token_hex(6)}"
            path = f"/v1/rollouts/{self.rollout}/register"
            answer = self.client.post(path, headers=self.admin, json={"model": "scripted"})
            self.key = answer.json().get("api_key", "") if answer.status_code == 200 else ""
            self.turns = 0
            if not self.key:
                return 0, 0.0
        t0 = time.perf_counter()
        answer = self.client.post(
            f"/v1/rollouts/{self.rollout}/chat/completions",
            json=self.BODY,
            headers={"Authorization": f"Bearer {self.key}"},
        )
        ms = (time.perf_counter() - t0) * 1000
        self.turns += 1
        if answer.status_code in (401, 403, 404):
            self.key = ""  # refused or gone: a new rollout
        return answer.status_code, ms

    def close(self, final: bool = False) -> None:
        """Unregister the current rollout and those whose unregistration failed before;
        ``final``: keep trying for up to 30 s (a canary leaves nothing registered)."""
        if self.rollout:
            self.pending.append(self.rollout)
            self.rollout = ""
        deadline = time.monotonic() + (30.0 if final else 0.0)
        while True:
            self.pending = [r for r in self.pending if not self._unregistered(r)]
            if not self.pending or time.monotonic() >= deadline:
                return
            time.sleep(1.0)

    def _unregistered(self, rollout: str) -> bool:
        """Whether the gateway answered the unregistration (200, or 404: not held)."""
        try:
            answer = self.client.post(f"/v1/rollouts/{rollout}/unregister", headers=self.admin)
        except httpx.HTTPError:
            return False
        return answer.status_code < 500


# -- readings ---------------------------------------------------------------------------------


def proc_numbers(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds, threads and CPU seconds so far of ``pid``, from ``/proc``.
    Its children's CPU is not read: an agent's is not handed to the env process that
    started it (bubblewrap's monitor does not wait for its sandbox's init)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status", "rb") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith(b"Threads:"))
        with open(f"/proc/{pid}/stat", "rb") as f:  # after the name: utime is the 12th
            utime, stime = map(int, f.read().rsplit(b")", 1)[1].split()[11:13])
    except (OSError, ValueError, StopIteration):
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    return {
        "rss_mb": round(rss / 2**20, 2), "fds": fds, "threads": threads,
        "cpu_s": (utime + stime) / tick,
    }  # fmt: skip


def machine_busy_cpu_s() -> float:
    """CPU seconds every core of the machine has been busy since boot (``/proc/stat``):
    the soak's own parts and whatever else the machine runs."""
    with open("/proc/stat", "rb") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def count_cgroups(names: set[str]) -> int:
    """How many of these sandboxes still have a cgroup (any controller's hierarchy)."""
    if not names:
        return 0
    found: set[str] = set()
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        if os.path.basename(top) == "rollout-gateway":
            found.update(d for d in dirs if d in names)
            dirs[:] = []
        elif top.count("/") > 8:
            dirs[:] = []
    return len(found)


def count_mounts(roots: list[str]) -> int:
    """Mounts under the sandbox roots (each sandbox's loop-mounted disk)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return sum(1 for line in f if any(line.split()[4].startswith(root) for root in roots))


def count_agent_processes(ids: set[str]) -> int:
    """Processes still running with a sandbox id in their environment or command line."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            data = (
                Path(f"/proc/{pid}/cmdline").read_bytes()
                + Path(f"/proc/{pid}/environ").read_bytes()
            )
            if any(i.encode() in data for i in ids):
                count += 1
    return count


def sandbox_ids_of(out: Path) -> set[str]:
    return {
        line["sandbox_id"]
        for journal in out.glob("env-*.jsonl")
        for line in read_lines(journal)
        if line.get("sandbox_id")
    }


#: Where ``.ci/run`` and the team brief make the v1 stack's virtualenv.
DEFAULT_V1_PYTHON = Path(__file__).resolve().parents[1] / ".ci-venv-v1" / "bin" / "python"


def v1_interpreter(given: str | None) -> str | None:
    """The interpreter of the v1 stack (``given``, else the repository's ``.ci-venv-v1``)
    when it imports ``rollout_gateway.v1`` on verifiers 0.4, else ``None``."""
    path = given or (str(DEFAULT_V1_PYTHON) if DEFAULT_V1_PYTHON.exists() else None)
    if path is None:
        return None
    probe = "import verifiers.v1, rollout_gateway.v1, rollout_gateway_fix_bug_v1"
    try:
        done = subprocess.run([path, "-c", probe], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


def file_mb(path: Path) -> float:
    try:
        return round(path.stat().st_size / 2**20, 3)
    except OSError:
        return 0.0


def _redis(port: int, *command: str) -> bytes:
    """One Redis command over RESP: a bulk reply's payload, else its first line."""
    request = f"*{len(command)}\r\n" + "".join(f"${len(c)}\r\n{c}\r\n" for c in command)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(request.encode())
        with s.makefile("rb") as reply:
            head = reply.readline().rstrip(b"\r\n")
            if head.startswith(b"$"):
                return reply.read(int(head[1:]))
            return head


def redis_numbers(port: int) -> dict[str, float]:
    """Redis's used memory (MiB) and its keys (thousands)."""
    try:
        info = _redis(port, "INFO", "memory").decode(errors="replace")
        keys = int(_redis(port, "DBSIZE").lstrip(b":"))
    except (OSError, ValueError):
        return {}
    used = next(
        (int(line.split(":")[1]) for line in info.splitlines() if line.startswith("used_memory:")),
        0,
    )
    return {"redis_used_mb": round(used / 2**20, 2), "redis_keys_k": round(keys / 1000, 3)}


def redis_rollout_keys(port: int) -> int | None:
    """Rollout hashes left in Redis (``<prefix>r:<id>``)."""
    try:
        return int(_redis(port, "EVAL", "return #redis.call('KEYS', '*r:*')", "0").lstrip(b":"))
    except (OSError, ValueError):
        return None


# -- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--quick", action="store_true", help="3 minutes, chaos compressed")
    p.add_argument("--seed", type=int, default=None, help="the chaos and faults (printed)")
    p.add_argument(
        "--out", type=Path, default=None, help="run directory (default: a new one in /tmp)"
    )
    p.add_argument("--concurrency", type=int, default=3, help="rollouts at once per env process")
    p.add_argument("--redis-envs", type=int, default=2)
    p.add_argument("--sqlite-envs", type=int, default=1)
    p.add_argument("--v1-envs", type=int, default=1, help="v1 env processes (through HAProxy)")
    p.add_argument(
        "--v1-python",
        default=None,
        help="the v1 stack's interpreter (default: the repository's .ci-venv-v1, if any)",
    )
    p.add_argument("--hostile-share", type=float, default=0.1)
    p.add_argument("--agent-timeout", type=float, default=120.0)
    p.add_argument("--drain-s", type=float, default=120.0)
    p.add_argument("--model-latency-ms", type=float, default=50.0)
    p.add_argument("--fault-error-rate", type=float, default=0.01)
    p.add_argument("--fault-slow-rate", type=float, default=0.01)
    p.add_argument("--fault-slow-s", type=float, default=3.0)
    p.add_argument("--fault-drop-rate", type=float, default=0.01)
    p.add_argument(
        "--gateway-kill-every", type=float, default=150.0, help="seconds between kill -9s"
    )
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--sqlite-volume-mb", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:  # every fault once or more in 3 minutes (about 4.5 with the drain)
        args.minutes = min(args.minutes, 3.0)
        args.gateway_kill_every = min(args.gateway_kill_every, 35.0)
        args.outage_s = min(args.outage_s, 20.0)
        args.drain_s = min(args.drain_s, 90.0)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out or Path(
        f"/tmp/rollout-gateway-soak-{time.strftime('%Y%m%d-%H%M%S')}-{args.seed}"
    )
    out.mkdir(parents=True, exist_ok=False)
    print(f"soak: seed {args.seed}, {args.minutes:g} min, out {out}", flush=True)
    for binary in ("redis-server", "haproxy"):
        if shutil.which(binary) is None and not os.path.exists(f"/usr/sbin/{binary}"):
            print(f"soak: {binary} is not installed")
            return 2
    soak = Soak(args, out)
    threads: list[threading.Thread] = []
    try:
        soak.start()
        threads = [
            threading.Thread(target=target, name=target.__name__, daemon=True)
            for target in (soak.chaos, soak.run_sampler, soak.run_canary, soak.run_health_watch)
        ]
        for thread in threads:
            thread.start()
        time.sleep(max(0.0, args.minutes * 60 - soak.now()))
        soak.event("end of the run: envs drain")
        soak.stopping.set()
        threads[0].join()  # a chaos step under way finishes (a restart completes)
        resumed_by = time.monotonic() + 120
        for env in soak.envs:
            env.wait_resumed(resumed_by)
        for env in soak.envs:  # all at once: they drain side by side
            env.terminate()
        deadline = time.monotonic() + args.drain_s + 30
        codes = {env.name: env.wait(deadline) for env in soak.envs}
        soak.event("envs stopped", exit_codes=codes)
        for thread in threads[1:]:
            thread.join(timeout=30)
        soak.rows.append(soak.sample())
        time.sleep(2.0)
        left = soak.end_state()
    finally:
        soak.stopping.set()
        for env in getattr(soak, "envs", []):
            env.kill()
        soak.stop_servers()
    return report(soak, left, args, out)


def report(soak: Soak, left: dict[str, Any], args: argparse.Namespace, out: Path) -> int:
    ledger = ledger_check(out)
    warmup = min(300.0, args.minutes * 60 * 0.2)
    fitted = slopes(soak.rows, warmup)
    window = 10 if args.minutes >= 25 else max(1, int(args.minutes // 3))
    drift = latency_drift(soak.canary, window, injected_slow_ms=args.fault_slow_s * 1000)
    write_csv(out / "samples.csv", soak.rows)
    write_csv(out / "canary.csv", soak.canary)
    (out / "events.json").write_text(json.dumps(soak.events, indent=1))
    (out / "health.json").write_text(json.dumps(soak.health, indent=1))
    png = draw(out, soak.rows, soak.events, soak.canary, soak.health)
    summary = {
        "seed": args.seed,
        "minutes": args.minutes,
        "concurrency": {"per_env": args.concurrency, "envs": len(soak.envs)},
        "ledger": ledger,
        "end_state": left,
        "slopes": fitted,
        "latency_drift": drift,
        "latency_per_minute": latency_by_minute(soak.canary),
        "cpu": cpu_by_part(soak.rows, ledger["counts"].get("started", 0), _own_cpu_s()),
        "health_changes": soak.health,
        "chaos": [
            e for e in soak.events if e["what"].startswith(("kill", "restart", "model", "fill"))
        ],
        "png": str(png) if png else "not drawn: pip install matplotlib",
    }
    (out / "report.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    return 0 if ledger["ok"] and leftovers_of(left) == 0 else 1


def _own_cpu_s() -> float:
    """The harness's own CPU seconds (its canary, sampler and health watch threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def leftovers_of(left: dict[str, Any]) -> int:
    """Everything the end state counts: sandboxes, cgroups, mounts, agents, rollouts
    registered in Redis and each gateway's registered copies (as its ``/health`` counts
    them: a copy a gateway kept of a rollout unregistered elsewhere is left over too)."""
    per_gateway = left.get("registered_rollouts_per_gateway", {})
    copies = sum(n for n in per_gateway.values() if isinstance(n, int))
    return copies + sum(v for v in left.values() if isinstance(v, int))


def print_summary(s: dict[str, Any]) -> None:
    """The report's figures, as the issue's closing note gives them."""
    c = s["ledger"]["counts"]
    verdict = "OK" if s["ledger"]["ok"] else "FAIL"
    print(f"\n== soak report (seed {s['seed']}, {s['minutes']:g} min, {s['concurrency']})")
    print(
        f"ledger: started {c.get('started', 0)}, completed {c.get('completed', 0)}, failed "
        f"typed {c.get('failed_typed', 0)}, interrupted by env kill "
        f"{c.get('interrupted_by_env_kill', 0)}, cancelled at the stop "
        f"{c.get('cancelled_at_the_stop', 0)}; lost {c.get('lost', 0)}, duplicated "
        f"{c.get('duplicated', 0)}, silently truncated {c.get('silently_truncated', 0)}, "
        f"untyped {c.get('untyped', 0)}  -> {verdict}"
    )
    print(
        f"steps recorded {c.get('steps', 0)}, completions served {c.get('served', 0)}, served "
        f"but in no trajectory {c.get('served_not_in_a_trajectory', 0)} (failed turns, "
        "killed envs, the canary)"
    )
    print("per env process:", json.dumps(s["ledger"].get("per_env", {})))
    print("errors:", json.dumps(s["ledger"]["errors"]))
    if s["ledger"].get("examples"):
        print("examples:", json.dumps(s["ledger"]["examples"]))
    print("chaos:", ", ".join(f"{e['t']:.0f}s {e['what']}" for e in s["chaos"]))
    print("end state (all 0):", json.dumps(s["end_state"]))
    print("slopes after warm-up (% of mean per hour; target < 1):")
    for name, fit in s["slopes"].items():
        print(
            f"  {name:40s} {fit['pct_per_hour']:8.2f} %/h  "
            f"({fit['per_hour']:+.2f}/h of {fit['mean']:.1f}, {fit['minutes']} min)"
        )
    print("/health changes (t, gateway, status, reasons):")
    for change in s["health_changes"]:
        reasons = "; ".join(change["reasons"])
        print(f"  {change['t']:7.1f}s {change['gateway']:9s} {change['status']} {reasons}")
    print("latency p99, last window over first:", json.dumps(s["latency_drift"]), "(<= 1.2)")
    cpu = s["cpu"]
    print(
        f"CPU per rollout started ({cpu['started']} started, {cpu['span_s']:.0f} s sampled): "
        + ", ".join(f"{name} {value:.3f} s" for name, value in cpu["cpu_s_per_rollout"].items())
        + f"; these parts {cpu['total_cpu_s_per_rollout']:.3f} s. The machine was busy "
        f"{cpu['machine_busy_cpu_s']} CPU-s, {cpu['rest_cpu_s_per_rollout']} s a rollout more "
        "than these parts: the agents and their sandboxes, and any other work on the machine"
    )
    print("png:", s["png"])


if __name__ == "__main__":
    sys.exit(main())
