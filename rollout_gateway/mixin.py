"""``RolloutGatewayMixin``: gateway-mode rollouts for ``vf.CliAgentEnv``.

Compose it in front of ``CliAgentEnv``::

    class MyEnv(RolloutGatewayMixin, vf.CliAgentEnv):
        use_gateway = True

In gateway mode the inference server's rollout gateway serves the agent's model calls
and records the trajectory; the env only runs the lifecycle (register, tunnel, sandbox,
agent, wait, fetch trajectory, post_rollout, score, tear down). With
``use_gateway = False`` every method falls through to ``CliAgentEnv`` unchanged and no
gateway resource is created.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import verifiers as vf
from prime_sandboxes import BackgroundJob, BackgroundJobStatus, CreateSandboxRequest
from verifiers.envs.experimental.cli_agent_env import make_agent_error
from verifiers.envs.experimental.sandbox_mixin import is_retryable_sandbox_read_error
from verifiers.types import RolloutInput, SamplingArgs, State
from verifiers.utils.threaded_sandbox_client import ThreadedAsyncSandboxClient

from rollout_gateway import protocol
from rollout_gateway.client import GatewayClient, RetryPolicy
from rollout_gateway.errors import (
    AgentPollError,
    AgentStartError,
    EmptyTrajectoryError,
    GatewayConfigError,
    GatewayError,
    GatewayTunnelError,
    PostRolloutError,
    RolloutNotFoundError,
)
from rollout_gateway.polling import PollPolicy
from rollout_gateway.trajectory import apply_trajectory
from rollout_gateway.tunnels import (
    DirectTunnelProvider,
    PrimeTunnelProvider,
    TunnelPool,
    TunnelProvider,
)

if TYPE_CHECKING:
    _Base = vf.CliAgentEnv
else:
    _Base = object

logger = logging.getLogger(__name__)

#: Environment variable selecting the sandbox backend ("prime" or "local").
SANDBOX_BACKEND_ENV = "ROLLOUT_GATEWAY_SANDBOX_BACKEND"
#: Environment variable holding the gateway's control-plane token, if it requires one.
ADMIN_TOKEN_ENV = "ROLLOUT_GATEWAY_ADMIN_TOKEN"
#: What the agent gets as OPENAI_API_KEY when the gateway issues no per-rollout key.
PLACEHOLDER_API_KEY = "rollout-gateway-no-key"

_SANDBOX_BACKENDS = ("prime", "local")
_TUNNEL_PROVIDERS = ("prime", "direct")


@contextlib.contextmanager
def _stage(what: str, error_type: type[vf.Error]) -> Iterator[None]:
    """Turn an untyped failure of one lifecycle stage into ``error_type``."""
    try:
        yield
    except vf.Error:
        raise
    except Exception as e:
        raise error_type(f"{what} failed: {type(e).__name__}: {e}") from e


def _set_error(state: State, error: vf.Error) -> None:
    """Record ``error`` unless an earlier one explains the rollout better."""
    if state.get("error") is None:
        state["error"] = error


class RolloutGatewayMixin(_Base):
    """Gateway mode for ``vf.CliAgentEnv`` (put it before ``CliAgentEnv`` in the bases).

    Class attributes (each overridable per instance through the constructor):

    - ``use_gateway``: run rollouts through the rollout gateway (default ``False``).
    - ``allow_empty_trajectory``: keep a rollout whose agent made no model call as a
      normal zero-turn rollout instead of failing it with :class:`EmptyTrajectoryError`.
    - ``sandbox_backend``: ``"prime"`` (prime-sandboxes, default) or ``"local"``
      (:class:`rollout_gateway.LocalSandboxClient`); the ``ROLLOUT_GATEWAY_SANDBOX_BACKEND``
      environment variable overrides the class default.

    Constructor keywords besides ``CliAgentEnv``'s: ``use_gateway``,
    ``allow_empty_trajectory``, ``sandbox_backend``, ``local_sandbox_root``,
    ``sandbox_client`` (any object with prime-sandboxes' async client methods), and every
    argument of :meth:`init_gateway` (``gateway_port``, ``gateway_url``,
    ``gateway_timeout_seconds``, ``tunnel_provider``, ``gateway_transport``,
    ``gateway_admin_token``, ``gateway_retry``, ``poll_policy``).
    """

    use_gateway: bool = False
    allow_empty_trajectory: bool = False
    sandbox_backend: str = "prime"

    def __init__(
        self,
        *args: Any,
        use_gateway: bool | None = None,
        allow_empty_trajectory: bool | None = None,
        sandbox_backend: str | None = None,
        local_sandbox_root: str | None = None,
        sandbox_client: Any | None = None,
        gateway_port: int | None = None,
        gateway_url: str | None = None,
        gateway_timeout_seconds: float | None = None,
        tunnel_provider: TunnelProvider | str | None = None,
        gateway_transport: httpx.AsyncBaseTransport | None = None,
        gateway_admin_token: str | None = None,
        gateway_retry: RetryPolicy | None = None,
        poll_policy: PollPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if use_gateway is not None:
            self.use_gateway = use_gateway
        if allow_empty_trajectory is not None:
            self.allow_empty_trajectory = allow_empty_trajectory
        backend = sandbox_backend or os.environ.get(SANDBOX_BACKEND_ENV) or self.sandbox_backend
        if backend not in _SANDBOX_BACKENDS:
            raise GatewayConfigError(
                f"sandbox_backend must be one of {_SANDBOX_BACKENDS}, got {backend!r}"
            )
        self.sandbox_backend = backend
        if sandbox_client is not None:
            self._replace_sandbox_client(sandbox_client)
        elif backend == "local":
            from rollout_gateway.local_sandbox import LocalSandboxClient

            self._replace_sandbox_client(LocalSandboxClient(root=local_sandbox_root))
        self._gateway_clients: dict[str, GatewayClient] = {}
        self._rollout_api_keys: dict[str, str] = {}
        self._tunnel_pool: TunnelPool | None = None
        self._gateway_initialized = False
        if self.use_gateway:
            options = {
                "gateway_port": gateway_port,
                "gateway_url": gateway_url,
                "timeout_seconds": gateway_timeout_seconds,
                "tunnel_provider": tunnel_provider,
                "transport": gateway_transport,
                "admin_token": gateway_admin_token,
                "retry": gateway_retry,
                "poll_policy": poll_policy,
            }
            self.init_gateway(**{k: v for k, v in options.items() if v is not None})

    # ------------------------------------------------------------------ configuration

    def init_gateway(
        self,
        gateway_port: int = 8000,
        timeout_seconds: float = 3600.0,
        *,
        gateway_url: str | None = None,
        tunnel_provider: TunnelProvider | str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        admin_token: str | None = None,
        retry: RetryPolicy | None = None,
        poll_policy: PollPolicy | None = None,
        tunnel_health_check_interval: float = 60.0,
    ) -> None:
        """Configure gateway mode. Resources (HTTP clients, tunnels) start lazily.

        Args:
            gateway_port: port of the gateway when the client's base URL names none.
            timeout_seconds: how long an agent may run before it is stopped
                (``agent_timed_out``, stop condition ``agent_timeout``).
            gateway_url: gateway root to use instead of the one derived from the model
                client's base URL (``/v1`` stripped).
            tunnel_provider: ``"prime"``, ``"direct"`` or a :class:`TunnelProvider`.
                Default: ``"direct"`` with the local sandbox backend, else ``"prime"``.
            transport: httpx transport for the control-plane client (tests, proxies).
            admin_token: control-plane bearer token (default: ``$ROLLOUT_GATEWAY_ADMIN_TOKEN``).
            retry: retry policy of control-plane calls.
            poll_policy: how often to poll the agent's job.
            tunnel_health_check_interval: seconds between server-side tunnel checks.

        May be called again before rollouts start (e.g. from a subclass ``__init__``).
        """
        if timeout_seconds is None or timeout_seconds <= 0:
            raise GatewayConfigError("gateway timeout_seconds must be positive")
        if not 0 < int(gateway_port) < 65536:
            raise GatewayConfigError(f"gateway_port out of range: {gateway_port}")
        if gateway_url is not None and not gateway_url.startswith(("http://", "https://")):
            raise GatewayConfigError(f"gateway_url must be an http(s) URL, got {gateway_url!r}")
        if tunnel_provider is None:
            tunnel_provider = "direct" if self.sandbox_backend == "local" else "prime"
        if isinstance(tunnel_provider, str):
            if tunnel_provider not in _TUNNEL_PROVIDERS:
                raise GatewayConfigError(
                    f"tunnel_provider must be one of {_TUNNEL_PROVIDERS} or a TunnelProvider"
                )
            provider: TunnelProvider = (
                DirectTunnelProvider() if tunnel_provider == "direct" else PrimeTunnelProvider()
            )
        else:
            provider = tunnel_provider
        self.gateway_port = int(gateway_port)
        self.gateway_timeout_seconds = float(timeout_seconds)
        self.gateway_url = protocol.gateway_root(gateway_url) if gateway_url else None
        self.gateway_transport = transport
        self.gateway_admin_token = admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
        self.gateway_retry = retry or RetryPolicy()
        self.poll_policy = poll_policy or PollPolicy()
        self.tunnel_provider = provider
        self._tunnel_pool = TunnelPool(
            provider,
            default_port=self.gateway_port,
            health_check_interval=tunnel_health_check_interval,
        )
        self._gateway_initialized = True

    def _ensure_gateway(self) -> None:
        # A rollout must never die on a missing attribute: fall back to the defaults.
        if not getattr(self, "_gateway_initialized", False):
            self.init_gateway()

    def _replace_sandbox_client(self, client: Any) -> None:
        threaded = getattr(self, "sandbox_client", None)
        if threaded is not None and hasattr(threaded, "teardown"):
            threaded.teardown(wait=False)  # its worker threads are not needed
        self.sandbox_client = client

    def get_gateway_client(self, gateway_url: str) -> GatewayClient:
        """The pooled control-plane client of ``gateway_url`` (one per gateway)."""
        client = self._gateway_clients.get(gateway_url)
        if client is None or client.is_closed:
            client = GatewayClient(
                gateway_url,
                admin_token=self.gateway_admin_token,
                retry=self.gateway_retry,
                transport=self.gateway_transport,
            )
            self._gateway_clients[gateway_url] = client
        return client

    def resolve_gateway_url(self, state: State) -> str:
        """Gateway root: ``gateway_url`` if set, else the model client's base URL minus ``/v1``."""
        if self.gateway_url:
            return self.gateway_url
        client = state.get("client")
        native = getattr(client, "client", None)
        base_url = getattr(native, "base_url", None)
        if base_url is None:
            config = getattr(client, "config", None)
            base_url = getattr(config, "api_base_url", None)
        if not base_url:
            raise GatewayConfigError(
                "cannot derive the gateway URL: the model client has no base_url; "
                "pass gateway_url=... to the env"
            )
        url = protocol.gateway_root(str(base_url))
        if not url.startswith(("http://", "https://")):
            raise GatewayConfigError(f"model client base URL {base_url!r} is not http(s)")
        return url

    # ------------------------------------------------------------------ lifecycle steps

    async def register_rollout(self, state: State) -> None:
        """Register the rollout with the gateway (model, sampling params, limits)."""
        client = self.get_gateway_client(state["gateway_url"])
        answer = await client.register(
            state["rollout_id"],
            model=state["model"],
            sampling_params=self.gateway_sampling_params(state),
            max_turns=self.max_turns if self.max_turns > 0 else protocol.UNLIMITED_TURNS,
            max_seq_len=self.max_seq_len,
        )
        state["gateway_registered"] = True
        api_key = answer.get("api_key")
        if api_key:
            self._rollout_api_keys[state["rollout_id"]] = api_key

    def gateway_sampling_params(self, state: State) -> dict[str, Any]:
        """Sampling params registered for the rollout: the env's, then the rollout's.

        ``extra_body`` entries (vLLM extensions such as ``top_k``) are flattened in, and
        ``n`` is dropped: the gateway serves one completion per turn.
        """
        params: dict[str, Any] = {}
        for source in (getattr(self, "sampling_args", None), state.get("sampling_args")):
            for key, value in (source or {}).items():
                if key == "extra_body":
                    params.update(value or {})
                elif key != "n" and value is not None:
                    params[key] = value
        return params

    async def unregister_rollout(self, state: State) -> None:
        """Unregister the rollout, once. A 404 means it is already gone."""
        rollout_id = state.get("rollout_id")
        self._rollout_api_keys.pop(rollout_id or "", None)
        if not state.get("gateway_registered") or state.get("gateway_unregistered"):
            return
        state["gateway_unregistered"] = True
        try:
            await self.get_gateway_client(state["gateway_url"]).unregister(rollout_id)
        except RolloutNotFoundError:
            logger.debug("rollout=%s already unregistered", rollout_id)
        except GatewayError as e:
            logger.warning("rollout=%s unregister failed: %s", rollout_id, e)
            _set_error(state, e)

    async def cancel_rollout(self, state: State) -> None:
        """Cancel the rollout at the gateway (best effort): its later turns are refused."""
        if not state.get("gateway_registered") or state.get("gateway_unregistered"):
            return
        try:
            await self.get_gateway_client(state["gateway_url"]).cancel(state["rollout_id"])
            state["gateway_cancelled"] = True
        except GatewayError as e:
            logger.warning("rollout=%s cancel failed: %s", state["rollout_id"], e)

    async def get_gateway_tunnel_url(self, state: State) -> str:
        """Public root URL of the gateway for the sandbox (shared tunnel per host)."""
        self._ensure_gateway()
        assert self._tunnel_pool is not None
        return await self._tunnel_pool.get_url(state["gateway_url"])

    async def fetch_trajectory(self, state: State) -> None:
        """Fetch the trajectory and write it into the state (see :mod:`.trajectory`)."""
        answer = await self.get_gateway_client(state["gateway_url"]).get_trajectory(
            state["rollout_id"]
        )
        steps = apply_trajectory(state, answer)
        state["gateway_trajectory_fetched"] = True
        for step in steps:
            self.increment_state_usage_from_response(state, step["response"])

    async def build_env_vars(self, state: State) -> dict[str, str]:
        """Sandbox environment: the env's ``environment_vars`` plus the OpenAI settings.

        Nothing from the host's environment is passed; the OpenAI variables always win
        over ``environment_vars`` so the agent cannot be pointed elsewhere by accident.
        """
        if not self.use_gateway:
            return await super().build_env_vars(state)
        env_vars = dict(self.environment_vars) if self.environment_vars else {}
        env_vars["OPENAI_BASE_URL"] = state["rollout_base_url"]
        env_vars["OPENAI_API_KEY"] = self._rollout_api_keys.get(
            state["rollout_id"], PLACEHOLDER_API_KEY
        )
        env_vars["OPENAI_MODEL"] = state["model"]
        timeout = str(int(self.gateway_timeout_seconds))
        for key in ("OPENAI_TIMEOUT", "OPENAI_REQUEST_TIMEOUT", "HTTPX_TIMEOUT"):
            env_vars.setdefault(key, timeout)
        return env_vars

    async def build_sandbox_request(
        self, state: State, env_vars: dict[str, str]
    ) -> CreateSandboxRequest:
        """The sandbox request, from ``CliAgentEnv``'s own settings and hooks."""
        resources = self.get_sandbox_resources(state)
        return CreateSandboxRequest(
            name=state["rollout_id"],
            docker_image=await self.get_docker_image(state),
            start_command=self.start_command,
            cpu_cores=resources["cpu_cores"],
            memory_gb=resources["memory_gb"],
            disk_size_gb=resources["disk_size_gb"],
            gpu_count=resources["gpu_count"],
            gpu_type=resources.get("gpu_type"),
            vm=resources.get("vm", resources["gpu_count"] > 0),
            timeout_minutes=resources["timeout_minutes"],
            environment_vars=env_vars,
            team_id=self.team_id,
            advanced_configs=self.advanced_configs,
            labels=self.labels if self.labels else [],
        )

    async def start_agent(self, state: State) -> None:
        """Start ``run_command`` as a background job in the rollout's sandbox."""
        if not self.use_gateway:
            return await super().start_agent(state)
        try:
            job = await self.sandbox_client.start_background_job(
                state["sandbox_id"], self.run_command
            )
        except Exception as e:
            raise AgentStartError(f"failed to start agent: {e}") from e
        state["background_job"] = job
        state["agent_start_time"] = time.time()

    async def poll_job_completion(
        self, state: State, sandbox_id: str, background_job: BackgroundJob
    ) -> None:
        """Poll the agent's job until it exits (adaptive interval, see :class:`PollPolicy`).

        Records ``agent_exit_code``, ``agent_stdout`` and ``agent_stderr``. Transient
        read errors are retried; ``max_consecutive_read_errors`` in a row fail polling.
        """
        if not self.use_gateway:
            return await super().poll_job_completion(state, sandbox_id, background_job)
        self._ensure_gateway()
        policy = self.poll_policy
        started = time.monotonic()
        read_errors = 0
        state["agent_polls"] = 0
        while True:
            state["agent_polls"] += 1
            try:
                status: BackgroundJobStatus = await self.sandbox_client.get_background_job(
                    sandbox_id, background_job, timeout=self.timeouts.poll
                )
            except Exception as e:
                if not is_retryable_sandbox_read_error(e):
                    raise AgentPollError(f"polling the agent failed: {e}") from e
                read_errors += 1
                if read_errors >= policy.max_consecutive_read_errors:
                    raise AgentPollError(
                        f"polling the agent failed {read_errors} times in a row: {e}"
                    ) from e
                logger.warning("rollout=%s transient poll error: %s", state["rollout_id"], e)
            else:
                read_errors = 0
                if status.completed:
                    state["agent_exit_code"] = status.exit_code
                    state["agent_stdout"] = status.stdout
                    state["agent_stderr"] = status.stderr
                    state["agent_end_time"] = time.time()
                    return
            await asyncio.sleep(policy.interval(time.monotonic() - started))

    async def wait_for_agent_completion(self, state: State) -> None:
        """Wait for the agent to exit, bounded by the gateway timeout.

        On timeout: ``agent_timed_out`` (stop condition ``agent_timeout``), and the
        rollout is cancelled at the gateway so the still-running agent adds no turn.
        """
        self._ensure_gateway()
        try:
            await asyncio.wait_for(
                self.poll_job_completion(state, state["sandbox_id"], state["background_job"]),
                timeout=self.gateway_timeout_seconds,
            )
        except TimeoutError:
            state["agent_timed_out"] = True
            state["timed_out"] = True  # CliAgentMonitorRubric's agent_timeout metric
            await self.cancel_rollout(state)
        else:
            state["agent_timed_out"] = False
        state["agent_completed"] = True

    # ------------------------------------------------------------------ the rollout

    async def rollout(
        self,
        input: RolloutInput,
        client: Any,
        model: str,
        sampling_args: SamplingArgs | None = None,
    ) -> State:
        """Run one rollout; in gateway mode nothing but cancellation escapes."""
        if not self.use_gateway:
            return await super().rollout(input, client, model, sampling_args)
        state = await self.init_state(input, client, model, sampling_args)
        state["rollout_id"] = protocol.new_rollout_id()
        cancelled = timed_out = False
        try:
            await asyncio.wait_for(self._run_gateway_rollout(state), timeout=self.timeout_seconds)
        except asyncio.CancelledError:
            cancelled = True
        except TimeoutError:
            timed_out = True
            self.mark_timed_out(state)
        except vf.Error as e:
            _set_error(state, e)
        except Exception as e:  # a bug in an override: typed, and the env keeps running
            _set_error(state, vf.InfraError(f"rollout failed: {type(e).__name__}: {e}"))
        # Cleanup runs to its end even if the rollout is cancelled (again) meanwhile.
        finalize = asyncio.ensure_future(
            self._finalize_gateway_rollout(state, cancelled=cancelled, timed_out=timed_out)
        )
        while not finalize.done():
            try:
                await asyncio.shield(finalize)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        return state

    async def _run_gateway_rollout(self, state: State) -> None:
        timing = state["timing"]
        timing.generation.start = timing.setup.start = time.time()
        self._ensure_gateway()
        state["gateway_url"] = self.resolve_gateway_url(state)
        with _stage("register", GatewayError):
            await self.register_rollout(state)
        with _stage("tunnel", GatewayTunnelError):
            state["tunnel_url"] = await self.get_gateway_tunnel_url(state)
        state["rollout_base_url"] = protocol.rollout_base_url(
            state["tunnel_url"], state["rollout_id"]
        )
        with _stage("sandbox request", vf.SandboxError):
            env_vars = await self.build_env_vars(state)
            request = await self.build_sandbox_request(state, env_vars)
        with _stage("sandbox creation", vf.SandboxError):
            await self.create_sandbox(state, request)
        with _stage("agent start", AgentStartError):
            await self.start_agent(state)
        timing.setup.end = time.time()
        with _stage("agent polling", AgentPollError):
            await self.wait_for_agent_completion(state)
        with _stage("trajectory fetch", GatewayError):
            await self.fetch_trajectory(state)
        self._check_agent_outcome(state)

    def _check_agent_outcome(self, state: State) -> None:
        num_turns = len(state["trajectory"])
        exit_code = state.get("agent_exit_code")
        if exit_code not in (None, 0) and not state.get("agent_timed_out"):
            where = "before any model call" if num_turns == 0 else f"after {num_turns} turn(s)"
            stderr_tail = (state.get("agent_stderr") or "")[-2000:]
            _set_error(
                state,
                make_agent_error(
                    state, f"Agent crashed {where} (exit_code={exit_code}): {stderr_tail}"
                ),
            )
        if num_turns == 0 and not self.allow_empty_trajectory:
            _set_error(
                state,
                EmptyTrajectoryError(
                    f"agent exited (exit_code={exit_code}) without a model call "
                    f"(rollout_id={state['rollout_id']})"
                ),
            )

    async def _fetch_trajectory_quietly(self, state: State) -> None:
        # After a timeout, keep what the gateway recorded so far: nothing lost.
        if not state.get("gateway_registered") or state.get("gateway_trajectory_fetched"):
            return
        try:
            await self.fetch_trajectory(state)
        except vf.Error as e:
            logger.warning(
                "rollout=%s trajectory fetch after timeout failed: %s", state["rollout_id"], e
            )

    async def _finalize_gateway_rollout(
        self, state: State, *, cancelled: bool, timed_out: bool
    ) -> None:
        """Gateway cancel, stop condition, cleanup handlers and the safety net. Never raises."""
        try:
            if cancelled or timed_out:
                await self.cancel_rollout(state)
            if timed_out:
                await self._fetch_trajectory_quietly(state)
            if not cancelled and not state.get("is_completed"):
                await self.is_completed(state)
        except Exception as e:
            logger.warning("rollout=%s finalization failed: %s", state.get("rollout_id"), e)
        try:
            await self.cleanup(state)
        except Exception as e:
            _set_error(state, vf.InfraError(f"rollout cleanup failed: {type(e).__name__}: {e}"))
        # Whatever a failing cleanup handler skipped: each step is idempotent.
        await self.unregister_rollout(state)
        await self._delete_rollout_sandbox(state)
        if not cancelled and state.get("error") is not None and not state.get("stop_condition"):
            state["stop_condition"] = "has_error"

    async def _delete_rollout_sandbox(self, state: State, keep: bool = False) -> None:
        sandbox_id = state.get("sandbox_id")
        if not sandbox_id or state.get("sandbox_deleted"):
            return
        state["sandbox_deleted"] = True
        if keep:  # keep_sandbox_for_scoring: the rubric deletes it
            self.deregister_sandbox(sandbox_id)
            return
        await self.delete_sandbox(sandbox_id)  # retries; logs instead of raising
        if sandbox_id in self.active_sandboxes:
            _set_error(
                state,
                vf.SandboxError(
                    f"sandbox {sandbox_id} could not be deleted; env teardown retries it"
                ),
            )

    # ------------------------------------------------------------------ verifiers hooks

    async def render_completion(self, state: State) -> None:
        """Use the gateway's ``completion`` when it sent one."""
        if self.use_gateway and state.get("gateway_completion") is not None:
            state["completion"] = state["gateway_completion"]
            return
        await super().render_completion(state)

    @vf.stop(priority=50)
    async def agent_timeout(self, state: State) -> bool:
        """Stop condition: the agent ran past the gateway timeout."""
        return bool(state.get("agent_timed_out"))

    @vf.cleanup
    async def destroy_sandbox(self, state: State) -> None:
        """Run ``post_rollout`` while the sandbox lives, then delete the sandbox, once."""
        if not self.use_gateway:
            return await super().destroy_sandbox(state)
        completed = bool(state.get("is_completed"))
        if completed and state.get("sandbox_id") and not state.get("post_rollout_done"):
            state["post_rollout_done"] = True
            try:
                await self.post_rollout(state)
            except vf.Error as e:
                _set_error(state, e)
            except Exception as e:
                _set_error(state, PostRolloutError(f"post_rollout failed: {type(e).__name__}: {e}"))
        await self._delete_rollout_sandbox(state, keep=self.keep_sandbox_for_scoring and completed)

    @vf.cleanup(priority=-50)
    async def unregister_gateway_rollout(self, state: State) -> None:
        """Unregister the rollout after post_rollout and sandbox deletion."""
        if self.use_gateway:
            await self.unregister_rollout(state)

    def teardown_sandboxes(self) -> None:
        """Delete every sandbox still tracked (local backend: kill and remove them)."""
        client = self.sandbox_client
        # The threaded prime client proxies every attribute name, so ask by type.
        if not isinstance(client, ThreadedAsyncSandboxClient) and hasattr(client, "delete_all"):
            client.delete_all()  # local / injected clients: no prime API involved
            self.active_sandboxes.clear()
            return
        super().teardown_sandboxes()

    @vf.teardown(priority=10)
    async def teardown_gateway(self) -> None:
        """Close the control-plane clients and stop every tunnel. Idempotent."""
        clients = list(getattr(self, "_gateway_clients", {}).values())
        if clients:
            self._gateway_clients.clear()
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        pool = getattr(self, "_tunnel_pool", None)
        if pool is not None:
            await pool.stop_all()


__all__ = ["ADMIN_TOKEN_ENV", "PLACEHOLDER_API_KEY", "SANDBOX_BACKEND_ENV", "RolloutGatewayMixin"]
