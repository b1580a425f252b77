"""Run ASGI apps (the gateway, the scripted model) with uvicorn: in-process or blocking.

In-process use (demos, integration tests, benchmarks)::

    import secrets

    from rollout_gateway.server import GatewayConfig, create_app
    from rollout_gateway.server.runner import running_server
    from rollout_gateway.scripted import create_scripted_model_app

    admin_token = secrets.token_urlsafe(32)
    async with running_server(create_scripted_model_app()) as model_root:
        config = GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=admin_token)
        async with running_server(create_app(config)) as gateway_root:
            ...  # gateway_root is "http://127.0.0.1:<port>"

From synchronous code, :func:`server_thread` does the same in a background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from rollout_gateway.server.config import DEFAULT_KEEP_ALIVE_S, GatewayConfig
from rollout_gateway.server.http.auth import is_loopback_host
from rollout_gateway.server.http.connections import uvicorn_options


def _gateway(app: Any) -> Any:
    """The app's gateway (:class:`~rollout_gateway.server.app.Gateway`), if it is one."""
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    return gateway if isinstance(getattr(gateway, "config", None), GatewayConfig) else None


def _uvicorn_config(app: Any, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    options: dict[str, Any] = {
        "log_level": "warning",
        "access_log": False,
        # Longer than client pools' idle timeout (httpx: 5 s): see DEFAULT_KEEP_ALIVE_S.
        "timeout_keep_alive": DEFAULT_KEEP_ALIVE_S,
        "lifespan": "on",
    }
    gateway = _gateway(app)
    if gateway is not None:
        config = gateway.config
        if config.open_control_plane and not is_loopback_host(host):
            raise ValueError(
                f"open_control_plane: a gateway without admin token only serves on a "
                f"loopback address, not {host!r}"
            )
        # Header/body timeouts, and the connection cap of its file-descriptor plan.
        options.update(uvicorn_options(config, gateway.fd_plan.agent_connections))
    options.update(kwargs)
    return uvicorn.Config(app, host=host, port=port, **options)


#: Seconds between the server's housekeeping passes (uvicorn's ``on_tick``: the ``Date``
#: header, the exit check). uvicorn wakes every 0.1 s for them; an exit request ends the
#: wait at once here, so once a second is enough.
DEFAULT_TICK_S = 1.0
#: uvicorn counts ticks of 0.1 s (it refreshes the ``Date`` header every 10th).
_UVICORN_TICKS_PER_TICK = 10


class _Server(uvicorn.Server):
    """uvicorn's server that idles quietly and ends the gateway's exit streams first.

    - uvicorn's main loop wakes every 0.1 s to see whether it should exit: about 1.9 ms of
      CPU a second on an idle gateway, which is most of its CPU per turn when turns come
      every half second. Here it wakes once a second, and setting ``should_exit`` (from
      a signal, another task or another thread) ends the wait at once.
    - uvicorn waits for every open answer to finish before the app's lifespan shutdown
      runs, and an exit stream never finishes by itself: ended first, it closes cleanly.
    """

    _should_exit = False
    _loop: asyncio.AbstractEventLoop | None = None
    _exit_requested: asyncio.Event | None = None

    def __init__(self, config: uvicorn.Config, tick_s: float = DEFAULT_TICK_S) -> None:
        super().__init__(config)
        self.tick_s = tick_s

    @property
    def should_exit(self) -> bool:
        """Whether the server should stop (uvicorn's flag; setting it wakes the loop)."""
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        loop, event = self._loop, self._exit_requested
        if value and loop is not None and event is not None:
            # A signal handler or another thread may set it; a loop that closed
            # meanwhile has nothing left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    async def main_loop(self) -> None:
        """uvicorn's main loop, one pass a second or at once when asked to exit."""
        self._exit_requested = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + _UVICORN_TICKS_PER_TICK) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick_s):
                    await self._exit_requested.wait()
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        gateway = getattr(getattr(self.config.app, "state", None), "gateway", None)
        streams = getattr(gateway, "exit_streams", None)
        if streams is not None:
            streams.close()
        await super().shutdown(sockets)


def _bound_port(server: uvicorn.Server) -> int:
    for srv in server.servers:
        for sock in srv.sockets:
            return int(sock.getsockname()[1])
    raise RuntimeError("uvicorn server has no listening socket")


async def _serve(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as exc:
        # uvicorn sys.exit()s on startup failure (port in use...); inside a task that
        # would escape the event loop and kill the caller's whole program.
        raise RuntimeError(f"uvicorn failed to start (exit code {exc.code})") from None


def _root_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


@contextlib.asynccontextmanager
async def running_server(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    startup_timeout_s: float = 10.0,
    tick_s: float = DEFAULT_TICK_S,
    **kwargs: Any,
) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn as a task of the running loop; yields its root URL.

    ``port=0`` binds a free port; the URL yielded (``http://host:port``, no path) has the
    port actually bound. The app's lifespan runs (startup before the URL is yielded,
    shutdown on exit). ``tick_s``: seconds between the server's housekeeping passes (an
    exit does not wait for one). Extra ``kwargs`` go to ``uvicorn.Config``. On exit the
    server stops accepting, finishes in-flight requests and shuts down.
    """
    server = _Server(_uvicorn_config(app, host, port, **kwargs), tick_s)
    task = asyncio.create_task(_serve(server))
    try:
        deadline = asyncio.get_running_loop().time() + startup_timeout_s
        while not server.started:
            if task.done():
                task.result()  # re-raises the startup error
                raise RuntimeError("uvicorn exited during startup")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"server did not start within {startup_timeout_s} s")
            await asyncio.sleep(0.005)
        yield _root_url(host, _bound_port(server))
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.contextmanager
def server_thread(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    startup_timeout_s: float = 10.0,
    tick_s: float = DEFAULT_TICK_S,
    **kwargs: Any,
) -> Iterator[str]:
    """Like :func:`running_server`, from synchronous code: uvicorn in a daemon thread."""
    server = _Server(_uvicorn_config(app, host, port, **kwargs), tick_s)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(_serve(server))
        except BaseException as exc:  # surfaced to the caller below
            errors.append(exc)

    thread = threading.Thread(target=run, name="rollout-gateway-uvicorn", daemon=True)
    thread.start()
    try:
        waited = 0.0
        while not server.started:
            if errors or not thread.is_alive():
                raise RuntimeError(f"server failed to start: {errors[:1]!r}")
            if waited > startup_timeout_s:
                raise TimeoutError(f"server did not start within {startup_timeout_s} s")
            thread.join(0.01)
            waited += 0.01
        yield _root_url(host, _bound_port(server))
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Serve ``app`` in the foreground until interrupted (what the CLI uses).

    ``app`` is an ASGI app or a :class:`~rollout_gateway.server.config.GatewayConfig`
    (a gateway app is then built from it). Extra ``kwargs`` go to ``uvicorn.Config``.
    A gateway's state is opened on the loop that serves it, before the server binds
    (:func:`~rollout_gateway.server.lifespan.open_state`): a store it cannot use raises
    its :class:`~rollout_gateway.server.state.store.StoreError` here, before serving.
    """
    if isinstance(app, GatewayConfig):
        from rollout_gateway.server.app import create_app

        app = create_app(app)
    options: dict[str, Any] = {"log_level": "info", "access_log": False}
    options.update(kwargs)
    server = _Server(_uvicorn_config(app, host, port, **options))
    gateway = _gateway(app)
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as loop:
        if gateway is not None:
            from rollout_gateway.server.lifespan import open_state

            loop.run(open_state(gateway))
        loop.run(server.serve())


__all__ = ["running_server", "serve", "server_thread"]
