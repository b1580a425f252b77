"""Scale-out on one machine: a Redis server, N gateway processes and HAProxy on loopback.

What the three-gateway tests and ``benchmarks/scaleout.py`` run, and a way to try
``serve --redis`` locally. Each piece is a real server from the distribution's packages
(``redis-server``, ``haproxy``; ``.ci/run`` installs them) or this package's own
``rollout-gateway serve``, started as a child process in its own process group on a free
loopback port, and stopped by that group only: nothing else on the machine is signalled.
Each dies with the process that started it, even one killed with ``kill -9``
(:mod:`rollout_gateway.child_processes`: the parent-death signal).

    with RedisServer(tmp_path) as redis, GatewayGroup(redis.url, upstream, 3) as gateways:
        with HAProxy(gateways.ports) as lb:
            ...  # lb.root is the one URL every env and agent uses

:class:`HAProxy` balances round robin with no stickiness (every request may land on any
gateway, keep-alive or not), takes a gateway out after two failed health checks, and
sends a request to another gateway only when it could not connect: a request a gateway
received is never sent again by the balancer (a gateway killed mid-request answers 502;
the agent's SDK retries, marking the retry, and the gateways recognise it: see
``docs/state.md``). It names the gateway that answered in an ``X-Gateway`` header (what
the tests look at).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from rollout_gateway import child_processes

#: How long a server may take to accept connections before start-up fails.
START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not listen on port {port}: {_tail(log)}")
        time.sleep(0.02)


def _tail(log: Path, chars: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


class _Child:
    """One child process in its own process group, its output in a log file."""

    def __init__(
        self,
        cmd: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.cmd = list(cmd)
        self.log = log
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The process id (it leads its own process group)."""
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        with open(self.log, "ab") as out:
            # Its own process group (stopped by that group only), killed by the kernel
            # should this process die without stopping it (``kill -9``).
            self.proc = child_processes.spawn(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                cwd=self.cwd,
            )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """``kill -9`` the process group (a crash, as the tests mean it)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            self._signal(signal.SIGKILL)  # any grandchild left in the group
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._signal(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # our own group (start_new_session)


class RedisServer:
    """``redis-server`` on a free loopback port, its data in ``directory``.

    Persistence is an append-only file synced on every write by default (``fsync=
    "always"``), so :meth:`restart` after :meth:`kill` (``kill -9``) has every write Redis
    acknowledged; ``fsync="everysec"`` is Redis's usual setting (up to a second of writes
    lost on a crash of the host), much cheaper per write (what a benchmark should run).
    """

    def __init__(self, directory: Path, *, port: int | None = None, fsync: str = "always") -> None:
        self.directory = Path(directory)
        self.port = port or free_port()
        self.fsync = fsync
        self._child: _Child | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self._child is not None
        return self._child.pid

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt install redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        cmd = [
            binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
            "--save", "", "--appendonly", "yes", "--appendfsync", self.fsync,
            "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
        ]  # fmt: skip
        self._child = _Child(cmd, self.directory / "redis.log")
        self._child.start()
        _wait_port(self.port, self._child.proc, "redis-server", self._child.log)  # type: ignore[arg-type]
        self._wait_loaded()
        return self

    def _wait_loaded(self) -> None:
        # After a restart Redis accepts connections while it loads its file (LOADING).
        deadline = time.monotonic() + START_TIMEOUT_S
        address = ("127.0.0.1", self.port)
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(address, 1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        raise TimeoutError("redis-server did not finish loading")

    def kill(self) -> None:
        """``kill -9`` Redis (its clients see their connections reset)."""
        if self._child is not None:
            self._child.kill()

    def restart(self) -> None:
        """Start it again on the same port and data (after :meth:`kill` or :meth:`stop`)."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayGroup:
    """``count`` gateway processes (``rollout-gateway serve --redis URL``) on free ports.

    Args:
        redis_url: the Redis every gateway shares.
        upstream: the upstream's OpenAI base URL.
        count: how many gateways.
        directory: where their logs go.
        admin_token: the control plane's token (passed through the environment).
        extra_args: more ``serve`` options, the same for every gateway.
        source: run the gateways of the ``rollout_gateway`` in this source tree instead
            of this one (a benchmark's other version: its directory is their working
            directory and first on their ``PYTHONPATH``).
    """

    def __init__(
        self,
        redis_url: str | None,
        upstream: str,
        count: int,
        directory: Path,
        *,
        admin_token: str,
        extra_args: Sequence[str] = (),
        source: Path | None = None,
    ) -> None:
        self.source = Path(source).resolve() if source is not None else None
        self.redis_url = redis_url
        self.upstream = upstream
        self.directory = Path(directory)
        self.admin_token = admin_token
        self.extra_args = list(extra_args)
        self.ports = [free_port() for _ in range(count)]
        self._children: list[_Child | None] = [None] * count

    def roots(self) -> list[str]:
        """Each gateway's own root URL."""
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def pids(self) -> list[int]:
        """Each running gateway's process id."""
        return [c.pid for c in self._children if c is not None and c.running()]

    def command(self, index: int) -> list[str]:
        cmd = [
            sys.executable, "-m", "rollout_gateway.cli", "serve",
            "--upstream", self.upstream, "--port", str(self.ports[index]), "--log-level", "warning",
        ]  # fmt: skip
        if self.redis_url is not None:
            cmd += ["--redis", self.redis_url]
        return cmd + self.extra_args

    def start_one(self, index: int) -> None:
        """Start gateway ``index`` (again, after :meth:`kill`) and wait until it serves."""
        self._wait_healthy(index, self._spawn(index))

    def _spawn(self, index: int) -> _Child:
        self.directory.mkdir(parents=True, exist_ok=True)
        child = _Child(
            self.command(index),
            self.directory / f"gateway{index}.log",
            env=self._env(),
            cwd=self.source,
        )
        child.start()
        self._children[index] = child
        return child

    def _env(self) -> dict[str, str]:
        env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": self.admin_token}
        if self.source is not None:
            rest = os.environ.get("PYTHONPATH", "")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.source), rest) if p)
        return env

    def _wait_healthy(self, index: int, child: _Child) -> None:
        # Serving (liveness), not ready: a gateway restarted while its upstream is down
        # serves, and HAProxy's readiness check keeps it out until the upstream answers.
        url = f"{self.roots()[index]}/health/live"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not child.running():
                raise RuntimeError(
                    f"gateway {index} exited with {child.proc.returncode}: {_tail(child.log)}"  # type: ignore[union-attr]
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway {index} did not start: {_tail(child.log)}")
            time.sleep(0.05)

    def kill(self, index: int) -> None:
        """``kill -9`` gateway ``index``."""
        child = self._children[index]
        if child is not None:
            child.kill()

    def log(self, index: int) -> str:
        """Gateway ``index``'s output so far."""
        return _tail(self.directory / f"gateway{index}.log", 1 << 20)

    def start(self) -> GatewayGroup:
        """Start every gateway at once, then wait until each serves."""
        try:
            for index in range(len(self.ports)):
                self._spawn(index)
            for index, child in enumerate(self._children):
                assert child is not None
                self._wait_healthy(index, child)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for child in self._children:
            if child is not None:
                child.stop()

    def __enter__(self) -> GatewayGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: HAProxy's configuration: HTTP mode, round robin, no stickiness. The client and server
#: timeouts outlast the gateway's ``--upstream-timeout`` (600 s) and a margin: a long
#: generation is not cut by the balancer. ``http-reuse never``
#: and ``http-server-close`` are left out on purpose: each request is balanced on its own
#: whatever connection it came on. ``retries``/``redispatch`` with ``retry-on
#: conn-failure`` (HAProxy's default, written out): a request that could not be sent goes
#: to another gateway; one a gateway received is never replayed (an ``empty-response``
#: retry would resend a turn whose answer was recorded but not sent as a new, unmarked
#: request). ``X-Gateway`` names the gateway that answered.
#:
#: Health: a gateway is in rotation while its ``/health`` (readiness: it reaches its store
#: and an upstream) answers 200, checked every 500 ms, out after two failures (about 2 s
#: after its upstream dies: the gateway probes every second) and back after one success.
#: When no gateway is ready (the upstream they share is down, or the store), requests go
#: to those that are alive (``/health/live``) rather than HAProxy's own 503: the control
#: plane (trajectories, unregister) still works and a turn gets the gateway's typed 502.
_HAPROXY_CONFIG = """\
global
    maxconn 4096
    log stderr format raw local0 err

defaults
    mode http
    log global
    timeout connect 2s
    timeout client 660s
    timeout server 660s
    timeout http-keep-alive 75s
    retries 3
    option redispatch 1
    retry-on conn-failure

frontend gateway
    bind 127.0.0.1:{port}
    use_backend gateways if {{ nbsrv(gateways) gt 0 }}
    default_backend gateways_alive

backend gateways
    balance {balance}
    http-response set-header X-Gateway %[srv_name]
    option httpchk GET /health
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1
{servers}

backend gateways_alive
    balance {balance}
    http-response set-header X-Gateway %[srv_name]
    option httpchk GET /health/live
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1
{servers}
"""


def haproxy_config(port: int, backend_ports: Sequence[int], *, balance: str = "roundrobin") -> str:
    """The HAProxy configuration :class:`HAProxy` runs (also the docs' example).
    ``balance``: HAProxy's algorithm (``uri`` sends each rollout's requests to one
    gateway: what the benchmark compares round robin with)."""
    servers = "\n".join(
        f"    server gateway{i} 127.0.0.1:{p} check" for i, p in enumerate(backend_ports)
    )
    return _HAPROXY_CONFIG.format(port=port, servers=servers, balance=balance)


class HAProxy:
    """HAProxy on a free loopback port, balancing over ``backend_ports``."""

    def __init__(
        self,
        backend_ports: Sequence[int],
        directory: Path,
        *,
        port: int | None = None,
        balance: str = "roundrobin",
    ) -> None:
        self.backend_ports = list(backend_ports)
        self.directory = Path(directory)
        self.port = port or free_port()
        self.balance = balance
        self._child: _Child | None = None

    @property
    def pid(self) -> int:
        """HAProxy's process id (it leads its own process group)."""
        assert self._child is not None
        return self._child.pid

    @property
    def root(self) -> str:
        """The balancer's root URL (what envs and agents are given)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HAProxy:
        binary = shutil.which("haproxy") or (
            "/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None
        )
        if binary is None:
            raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy)")
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "haproxy.cfg"
        config.write_text(haproxy_config(self.port, self.backend_ports, balance=self.balance))
        # -db: stay in the foreground, no daemon (stopped by its process group).
        self._child = _Child([binary, "-db", "-f", str(config)], self.directory / "haproxy.log")
        self._child.start()
        _wait_port(self.port, self._child.proc, "haproxy", self._child.log)  # type: ignore[arg-type]
        return self

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = ["GatewayGroup", "HAProxy", "RedisServer", "free_port", "haproxy_config"]
