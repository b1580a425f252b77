"""The agent's side of a 0.3 gateway rollout: its sandbox, its launch, its wait, its stop.

:class:`AgentSandboxSteps` holds the overridable steps of the earlier experimental
mixin (verifiers 0.1.11) that deal with the agent's sandbox, with their signatures:
``build_env_vars``, ``build_sandbox_request``, ``start_agent``, ``poll_job_completion``,
``wait_for_agent_completion``, ``stop_agent`` and ``delete_rollout_sandbox``, plus the
``CliAgentEnv`` hooks they change. :class:`rollout_gateway.classic.RolloutGatewayMixin`
builds on it; with ``use_gateway = False`` each falls through to ``CliAgentEnv``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import verifiers as vf
from prime_sandboxes import BackgroundJob, BackgroundJobStatus, CreateSandboxRequest
from verifiers.envs.experimental.sandbox_mixin import is_retryable_sandbox_read_error
from verifiers.types import State
from verifiers.utils.threaded_sandbox_client import ThreadedAsyncSandboxClient

from rollout_gateway.agent_wait import poll_until_exit, wait_for_agent
from rollout_gateway.classic.errors import to_vf_error
from rollout_gateway.classic.rollouts import StateRollouts
from rollout_gateway.errors import GatewayTunnelError, SandboxError
from rollout_gateway.launch import agent_launch_command, stop_agent_script
from rollout_gateway.lifecycle import (
    AGENT_TIMEOUT_VARS,
    AgentExit,
    GatewayRollout,
    agent_environment,
)
from rollout_gateway.local_sandbox import LocalSandboxClient
from rollout_gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from verifiers.legacy.envs.experimental.cli_agent_env import CliAgentEnv as _Base
else:
    _Base = object


class AgentSandboxSteps(_Base):
    """The sandbox and agent steps of a gateway rollout (a base of ``RolloutGatewayMixin``)."""

    use_gateway: bool
    gateway_settings: GatewaySettings
    _gateway_rollouts: StateRollouts

    def _core(self, state: State) -> GatewayRollout:
        """The core rollout of ``state``, also for a step called on its own (:mod:`.rollouts`)."""
        return self._gateway_rollouts.of(state)

    async def build_env_vars(self, state: State) -> dict[str, str]:
        """Sandbox environment: the env's ``environment_vars`` plus the agent's model settings
        (:func:`~rollout_gateway.lifecycle.agent_environment`: the OpenAI and Anthropic
        clients' variables).

        Nothing from the host's environment is passed. The agent's base URL, key and
        model always win over ``environment_vars``, so the agent cannot be pointed
        elsewhere by accident; its client timeouts (``OPENAI_TIMEOUT``,
        ``OPENAI_REQUEST_TIMEOUT``, ``HTTPX_TIMEOUT``) are defaults that the env's own
        values override, as with the earlier mixin.
        """
        if not self.use_gateway:
            return await super().build_env_vars(state)
        env_vars = dict(self.environment_vars) if self.environment_vars else {}
        rollout = self._gateway_rollouts.get(state)
        agent_env = agent_environment(
            state["rollout_base_url"],
            rollout.record.api_key if rollout is not None else None,
            state["model"],
            self.gateway_settings.agent_timeout,
        )
        for name, value in agent_env.items():
            if name in AGENT_TIMEOUT_VARS:
                env_vars.setdefault(name, value)
            else:
                env_vars[name] = value
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
        reports = self.gateway_settings.exit_reports
        command = agent_launch_command(self.run_command, report_exit=reports)
        job = await self.sandbox_client.start_background_job(state["sandbox_id"], command)
        state["background_job"] = job
        state["agent_start_time"] = time.time()
        rollout = self._gateway_rollouts.get(state)
        if rollout is not None:  # the wrapper reports the agent's start and exit
            rollout.record.agent_reports = reports

    async def poll_job_completion(
        self, state: State, sandbox_id: str, background_job: BackgroundJob
    ) -> None:
        """Poll the agent's job until it exits (adaptive, see :class:`PollPolicy`).

        Called on its own (not by ``wait_for_agent_completion`` in a rollout), it also
        watches the tunnel of the state's gateway, as the earlier mixin did: its death
        raises ``vf.TunnelError`` (a :class:`GatewayTunnelError`).
        """
        if not self.use_gateway:
            return await super().poll_job_completion(state, sandbox_id, background_job)

        async def probe() -> AgentExit | None:
            status: BackgroundJobStatus = await self.sandbox_client.get_background_job(
                sandbox_id, background_job, timeout=self.timeouts.poll
            )
            if not status.completed:
                return None
            return AgentExit(status.exit_code, status.stdout or "", status.stderr or "")

        rollout = self._core(state)
        polling = poll_until_exit(
            rollout,
            probe,
            is_transient=is_retryable_sandbox_read_error,
            on_refusal=lambda: self.stop_agent(state),  # the rollout is over: end the agent
        )
        if self._gateway_rollouts.is_running(rollout):
            agent_exit = await polling  # wait_for_agent_completion watches the tunnel
        else:
            agent_exit = await self._polling_alone(rollout, state, polling)
        state["agent_polls"] = rollout.record.agent_polls
        state["agent_exit_code"] = agent_exit.exit_code
        state["agent_stdout"] = agent_exit.stdout
        state["agent_stderr"] = agent_exit.stderr
        state["agent_end_time"] = time.time()

    async def _polling_alone(
        self, rollout: GatewayRollout, state: State, polling: Awaitable[AgentExit]
    ) -> AgentExit:
        """``poll_job_completion`` called on its own: the poll, until the tunnel of the
        state's gateway (when it has one) dies."""
        if not (state.get("tunnel_local_addr") or state.get("tunnel_url")):
            return await polling
        try:
            await rollout.lease_tunnel()
            await wait_for_agent(rollout, polling, agent_timeout=False)
        except GatewayTunnelError as e:
            raise to_vf_error(e) from e.__cause__
        assert rollout.record.agent_exit is not None
        return rollout.record.agent_exit

    async def wait_for_agent_completion(self, state: State) -> None:
        """Wait for the agent to exit, bounded by the agent timeout.

        An agent started without a background job (an override that ran it to its end)
        is complete at once. On timeout: ``agent_timed_out`` (stop condition
        ``agent_timeout``); the core then cancels the rollout at the gateway and stops
        the agent before anything is scored.
        """
        sandbox_id, job = state.get("sandbox_id"), state.get("background_job")
        if sandbox_id and job:
            rollout = self._core(state)
            await wait_for_agent(rollout, self.poll_job_completion(state, sandbox_id, job))
            state["agent_timed_out"] = rollout.record.agent_timed_out
        else:
            state.setdefault("agent_timed_out", False)
        if state["agent_timed_out"]:
            state["timed_out"] = True  # CliAgentMonitorRubric's agent_timeout metric
        state["agent_completed"] = True

    async def stop_agent(self, state: State) -> None:
        """Stop a still-running agent (after a timeout), before scoring touches its files."""
        sandbox_id, job = state.get("sandbox_id"), state.get("background_job")
        if not sandbox_id:
            return
        if isinstance(self.sandbox_client, LocalSandboxClient):
            # From the host: in its namespace modes a command run inside cannot see the
            # agent (each command has its own PID namespace).
            await asyncio.to_thread(self.sandbox_client.stop_processes, sandbox_id)
        else:
            await self.sandbox_client.execute_command(sandbox_id, stop_agent_script(), timeout=30)
        if job is None:
            return
        settings = self.gateway_settings
        grace = settings.agent_stop_grace
        deadline = settings.clock() + grace
        while True:  # let the job report its exit, so its output is kept
            status = await self.sandbox_client.get_background_job(sandbox_id, job, timeout=30)
            if status.completed:
                state["agent_exit_code"] = status.exit_code
                state["agent_stdout"], state["agent_stderr"] = status.stdout, status.stderr
                return
            if settings.clock() >= deadline:
                return
            await settings.sleep(min(0.2, grace))

    async def delete_rollout_sandbox(self, state: State) -> None:
        """Delete the rollout's sandbox (or keep it for scoring when so configured)."""
        sandbox_id = state.get("sandbox_id")
        if not sandbox_id:
            return
        if self.keep_sandbox_for_scoring and state.get("is_completed"):
            self.deregister_sandbox(sandbox_id)  # the rubric deletes it
            return
        await self.delete_sandbox(sandbox_id)  # SandboxMixin: retries, logs instead of raising
        if sandbox_id in self.active_sandboxes:
            raise SandboxError(f"sandbox {sandbox_id} could not be deleted; teardown retries it")

    @vf.stop(priority=50)
    async def agent_timeout(self, state: State) -> bool:
        """Stop condition: the agent ran past the agent timeout."""
        return bool(state.get("agent_timed_out"))

    @vf.cleanup
    async def destroy_sandbox(self, state: State) -> None:
        """Interception mode: ``CliAgentEnv``'s. Gateway mode: the core's finalize deletes."""
        if not self.use_gateway:
            await super().destroy_sandbox(state)

    def teardown_sandboxes(self) -> None:
        """Delete every sandbox still tracked (local backend: kill and remove them)."""
        client = self.sandbox_client
        # The threaded prime client proxies every attribute name, so ask by type.
        if not isinstance(client, ThreadedAsyncSandboxClient) and hasattr(client, "delete_all"):
            client.delete_all()  # local / injected clients: no prime API involved
            self.active_sandboxes.clear()
            return
        super().teardown_sandboxes()


__all__ = ["AgentSandboxSteps"]
