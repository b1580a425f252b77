"""A minimal CLI coding agent: chat with a model and run the shell commands it asks for.

Run inside the sandbox as ``python3 agent.py`` from the task's directory. Configuration
comes from the environment only:

- ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL``: the OpenAI-compatible endpoint
  (the rollout gateway, verifiers' interception server, or any real server).
- ``OPENAI_TIMEOUT``: seconds per model request (default 600).
- ``AGENT_MAX_TURNS``: model calls at most (default 10).
- ``AGENT_COMMAND_TIMEOUT``: seconds per shell command (default 60).
- ``AGENT_MAX_OUTPUT_CHARS``: tool output kept per command (default 8000).
- ``AGENT_TASK_FILE`` (default ``task.md``) or ``AGENT_TASK``: the task prompt.

The model gets one tool, ``run_shell(command)``; commands run with ``/bin/sh`` in the
agent's working directory. The agent stops when the model answers without a tool call,
after ``AGENT_MAX_TURNS`` model calls, or when the server refuses further turns (HTTP
403 from the reference rollout gateway, 409 from gateways following the original protocol
table: a spent turn budget, a cancelled rollout). Exit status: 0 on a
normal finish, 1 when the model API fails, 2 on bad configuration.

Standard library + ``openai`` only, so it runs in any sandbox image with Python 3.9+.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, cast

SYSTEM_PROMPT = (
    "You are a careful software engineer working in a terminal. You can run shell commands "
    "with the run_shell tool; each call runs in the repository's directory and returns the "
    "exit code and output. Inspect the code, make the fix, run the tests, and reply with a "
    "short summary (without calling a tool) when you are done."
)

RUN_SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command in the repository directory; returns exit code "
        "and combined stdout/stderr (truncated).",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(_fail(2, f"{name} must be an integer, got {raw!r}")) from None


def _fail(code: int, message: str) -> int:
    print(f"agent: {message}", file=sys.stderr, flush=True)
    return code


def read_task() -> str | None:
    """The task prompt: ``$AGENT_TASK_FILE`` (default ``task.md``), else ``$AGENT_TASK``."""
    path = os.environ.get("AGENT_TASK_FILE", "task.md")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        if text:
            return text
    return os.environ.get("AGENT_TASK", "").strip() or None


def truncate(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` characters."""
    if len(text) <= limit:
        return text
    half = max(limit // 2, 1)
    dropped = len(text) - 2 * half
    return f"{text[:half]}\n...[{dropped} characters truncated]...\n{text[-half:]}"


def run_shell(command: str, timeout: int, limit: int) -> str:
    """Run ``command`` with ``/bin/sh``; its whole process group dies on timeout."""
    proc = subprocess.Popen(
        ["/bin/sh", "-c", command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
        status = f"timed out after {timeout}s (killed)"
    text = output.decode("utf-8", errors="replace")
    return f"[{status}]\n{truncate(text, limit)}"


def tool_result(name: str, raw_arguments: str | None, timeout: int, limit: int) -> str:
    """Execute one tool call and return the text sent back to the model."""
    if name != "run_shell":
        return f"error: unknown tool {name!r}; the only tool is run_shell"
    try:
        arguments = json.loads(raw_arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: arguments are not valid JSON: {e}"
    command = arguments.get("command") if isinstance(arguments, dict) else None
    if not isinstance(command, str) or not command.strip():
        return 'error: run_shell needs {"command": "<shell command>"}'
    print(f"$ {command}", flush=True)
    result = run_shell(command, timeout, limit)
    print(result, flush=True)
    return result


def main() -> int:
    """Run the agent loop; the return value is the process exit status."""
    task = read_task()
    if task is None:
        return _fail(2, "no task: write task.md or set AGENT_TASK")
    try:
        import openai  # imported late: a configuration error fails fast without it
    except ImportError:
        return _fail(2, "the 'openai' package is not installed")
    model = os.environ.get("OPENAI_MODEL") or "model"
    max_turns = _env_int("AGENT_MAX_TURNS", 10)
    command_timeout = _env_int("AGENT_COMMAND_TIMEOUT", 60)
    output_limit = _env_int("AGENT_MAX_OUTPUT_CHARS", 8000)
    client = openai.OpenAI(
        # The SDK reads OPENAI_BASE_URL itself; a placeholder key keeps keyless servers usable.
        api_key=os.environ.get("OPENAI_API_KEY") or "not-needed",
        timeout=float(os.environ.get("OPENAI_TIMEOUT") or 600),
        max_retries=2,
    )

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task},
    ]
    for _ in range(max_turns):
        try:
            response = client.chat.completions.create(
                model=model, messages=cast(Any, messages), tools=cast(Any, [RUN_SHELL_TOOL])
            )
        except (openai.ConflictError, openai.PermissionDeniedError) as e:
            # The server closed this rollout (turn budget spent, cancelled): a normal end.
            print(f"agent: server ended the conversation: {e}", file=sys.stderr)
            return 0
        except openai.OpenAIError as e:
            return _fail(1, f"model request failed: {type(e).__name__}: {e}")
        if not response.choices:
            return _fail(1, "model response has no choices")
        message = response.choices[0].message
        tool_calls: list[Any] = list(message.tool_calls or [])  # function calls only
        assistant: dict[str, Any] = {"role": "assistant", "content": message.content}
        if tool_calls:
            assistant["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in tool_calls
            ]
        messages.append(assistant)
        if not tool_calls:
            print(message.content or "", flush=True)
            return 0
        for call in tool_calls:
            result = tool_result(
                call.function.name, call.function.arguments, command_timeout, output_limit
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(f"agent: stopped after AGENT_MAX_TURNS={max_turns} model calls", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
