"""``FixBugEnv``: a CLI agent fixes a bug in a tiny repository; reward = its tests pass.

Built on ``vf.CliAgentEnv`` with :class:`rollout_gateway.RolloutGatewayMixin` in front:
gateway mode by default, plain interception mode with ``use_gateway=False``.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import shlex
import socket
import tarfile
from collections.abc import Mapping
from importlib import resources
from typing import Any

import verifiers as vf
from datasets import Dataset

from rollout_gateway import RolloutGatewayMixin
from rollout_gateway.examples.fix_bug_env.tasks import build_dataset

logger = logging.getLogger(__name__)

#: Where the repository, ``agent.py`` and ``task.md`` go, relative to the sandbox's
#: working directory (relative so it means the same on prime sandboxes and locally).
DEFAULT_TASK_DIR = "fix_bug_task"
#: Make sure the agent's one dependency is importable (a no-op when it already is, as in
#: the local backend, which runs the host's Python).
DEFAULT_AGENT_SETUP = (
    # find_spec, not import: checking must not cost the second an openai import takes.
    "python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec(\"openai\") is None)' "
    "|| python3 -m pip install --quiet --disable-pip-version-check 'openai>=1.40'"
)


def agent_source() -> str:
    """The agent program shipped with this package (``agent.py`` next to this module)."""
    return (
        resources.files(__package__ or "rollout_gateway.examples.fix_bug_env")
        .joinpath("agent.py")
        .read_text(encoding="utf-8")
    )


def bundle_command(files: dict[str, str], dest_dir: str) -> str:
    """A shell command that writes ``files`` (relative path -> text) under ``dest_dir``.

    The files travel inside the command (a base64 tar.gz unpacked by ``python3``), so no
    file-transfer API or absolute path is needed: it works unchanged on prime sandboxes
    and on the local backend.
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, content in sorted(files.items()):
            data = content.encode("utf-8")
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    payload = base64.b64encode(buf.getvalue()).decode("ascii")
    script = (
        "import base64, io, sys, tarfile\n"
        f"data = base64.b64decode('{payload}')\n"
        "tar = tarfile.open(fileobj=io.BytesIO(data), mode='r:gz')\n"
        "kw = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}\n"
        "tar.extractall(sys.argv[1], **kw)\n"
    )
    dest = shlex.quote(dest_dir)
    return f"mkdir -p {dest} && python3 -c {shlex.quote(script)} {dest}"


def _message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else message.content
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if text:
            parts.append(text)
    return "\n".join(parts)


def task_text(state: vf.State) -> str:
    """The task for ``task.md``: the last user message of the rollout's prompt."""
    for message in reversed(state["prompt"] or []):
        role = message.get("role") if isinstance(message, dict) else message.role
        if role == "user":
            return _message_text(message)
    raise ValueError("the prompt has no user message")


async def tests_passed(state: vf.State, **kwargs: Any) -> float:
    """1.0 when the task's test passed in the sandbox after the agent ran, else 0.0."""
    return 1.0 if state.get("tests_passed") else 0.0


class FixBugEnv(RolloutGatewayMixin, vf.CliAgentEnv):
    """Run ``agent.py`` on a buggy repository in a sandbox and score it by its tests.

    Args (besides ``RolloutGatewayMixin`` / ``vf.CliAgentEnv`` keywords):
        task_dir: directory of the repository, relative to the sandbox's working dir.
        agent_max_turns: ``AGENT_MAX_TURNS`` of the agent (model calls).
        agent_command_timeout: seconds per shell command the agent runs.
        test_timeout: seconds for the scoring test run.
        agent_setup_command: run in the sandbox before the agent starts (``None``: skip).
        setup_timeout: seconds for each setup command (the upload, ``agent_setup_command``).
    """

    use_gateway = True

    def __init__(
        self,
        *,
        dataset: Dataset | None = None,
        rubric: vf.Rubric | None = None,
        task_dir: str = DEFAULT_TASK_DIR,
        agent_max_turns: int = 10,
        agent_command_timeout: int = 60,
        test_timeout: int = 120,
        agent_setup_command: str | None = DEFAULT_AGENT_SETUP,
        setup_timeout: int = 300,
        environment_vars: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        env_vars = {
            "AGENT_MAX_TURNS": str(agent_max_turns),
            "AGENT_COMMAND_TIMEOUT": str(agent_command_timeout),
            **(environment_vars or {}),
        }
        kwargs.setdefault("run_command", f"cd {shlex.quote(task_dir)} && python3 agent.py")
        kwargs.setdefault("docker_image", "python:3.11-slim")
        super().__init__(
            dataset=dataset if dataset is not None else build_dataset(),
            rubric=rubric if rubric is not None else vf.Rubric(funcs=[tests_passed]),
            environment_vars=env_vars,
            **kwargs,
        )
        self.task_dir = task_dir
        self.test_timeout = test_timeout
        self.agent_setup_command = agent_setup_command
        self.setup_timeout = setup_timeout

    async def post_sandbox_setup(self, state: vf.State) -> None:
        """Write the repository, ``agent.py`` and ``task.md`` into the sandbox."""
        await super().post_sandbox_setup(state)
        sandbox_id = state["sandbox_id"]
        files = {f["path"]: f["content"] for f in state["info"]["files"]}
        files["agent.py"] = agent_source()
        files["task.md"] = task_text(state)
        commands = [bundle_command(files, self.task_dir)]
        if self.agent_setup_command:
            commands.append(self.agent_setup_command)
        for command in commands:
            result = await self.sandbox_client.execute_command(
                sandbox_id, command, timeout=self.setup_timeout
            )
            if result.exit_code != 0:
                raise vf.SandboxError(
                    f"setup failed in {sandbox_id} (exit {result.exit_code}): "
                    f"{(result.stderr or result.stdout)[-500:]}"
                )

    async def post_rollout(self, state: vf.State) -> None:
        """Run the task's test in the sandbox (before it is deleted): ``tests_passed``."""
        await super().post_rollout(state)
        sandbox_id = state.get("sandbox_id")
        state["tests_passed"] = False
        if not sandbox_id:
            return
        command = f"cd {shlex.quote(self.task_dir)} && {state['info']['test_command']}"
        try:
            result = await self.sandbox_client.execute_command(
                sandbox_id, command, timeout=self.test_timeout
            )
        except Exception as e:
            # Not the policy's fault: mark the rollout as an infra failure, not a zero.
            logger.warning("Running the tests in %s failed: %r", sandbox_id, e)
            if state.get("error") is None:
                state["error"] = vf.SandboxError(f"test run failed in {sandbox_id}: {e!r}")
            return
        state["tests_passed"] = result.exit_code == 0
        state["test_output"] = ((result.stdout or "") + (result.stderr or ""))[-2000:]


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load_environment(
    num_examples: int = -1,
    use_gateway: bool = True,
    sandbox_backend: str | None = None,
    timeout_seconds: float = 900.0,
    **kwargs: Any,
) -> FixBugEnv:
    """Build the fix-the-bug environment.

    Args:
        num_examples: number of rows (-1: one per task; more cycle through the tasks).
        use_gateway: gateway mode (``True``) or plain ``CliAgentEnv`` interception mode
            (on the local backend, the interception server is then reached over loopback
            on ``interception_port``, a free port unless given; no tunnel).
        sandbox_backend: ``"local"`` or ``"prime"`` (default: the mixin's choice, which
            honours ``$ROLLOUT_GATEWAY_SANDBOX_BACKEND``).
        timeout_seconds: wall-clock cap of one rollout.
        **kwargs: passed to :class:`FixBugEnv` (and on to the mixin and ``CliAgentEnv``).
    """
    if sandbox_backend is not None:
        kwargs["sandbox_backend"] = sandbox_backend
    backend = sandbox_backend or os.environ.get("ROLLOUT_GATEWAY_SANDBOX_BACKEND")
    if not use_gateway and backend == "local" and kwargs.get("interception_url") is None:
        # Interception mode on this machine: the agent reaches CliAgentEnv's interception
        # server over loopback (local sandboxes share the host's network), so no prime
        # tunnel is needed. CliAgentEnv needs the URL up front, hence a fixed free port.
        port = kwargs.setdefault("interception_port", _free_loopback_port())
        kwargs["interception_url"] = f"http://127.0.0.1:{port}"
    gateway = kwargs.get("gateway")
    if use_gateway and (gateway is None or isinstance(gateway, Mapping)):
        # Stop the agent a little before the rollout cap so its trajectory is still fetched
        # (unless the caller chose an agent timeout; a GatewaySettings object is kept as is).
        settings = dict(gateway or {})
        if "gateway_timeout_seconds" not in kwargs:
            settings.setdefault("agent_timeout", max(timeout_seconds * 0.9, 1.0))
        kwargs["gateway"] = settings
    return FixBugEnv(
        dataset=build_dataset(num_examples),
        use_gateway=use_gateway,
        timeout_seconds=timeout_seconds,
        **kwargs,
    )
