"""How an agent is launched in a sandbox so that it can be stopped and reports its exit.

The agent's command runs behind a small POSIX ``sh`` wrapper that

- records its pid in the sandbox's own ``$TMPDIR`` (so :func:`stop_agent_script` can kill
  the agent's process tree after a timeout, before anything is scored), and
- reports the agent's exit code to the gateway (``POST {OPENAI_BASE_URL}/exit`` with the
  rollout's key, see :mod:`rollout_gateway.exits`) with whichever HTTP client the image
  has: curl, wget or python3; nothing if it has none (sandbox polling still notices), and
- says, as the agent starts, that it can: the same call with ``"started": true``, sent
  beside the agent (not before it). An image with none of those clients sends nothing,
  and an env that hears no start report of a rollout polls its sandbox adaptively
  instead of waiting for an exit report that cannot come.

Nothing here depends on verifiers: any adapter that starts agents with a shell command
uses it.
"""

from __future__ import annotations

import shlex

#: Where the launch wrapper records the agent's pid inside the sandbox (a shell word:
#: the sandbox's own TMPDIR, so sandboxes sharing a host's /tmp never share the file).
AGENT_PID_NAME = ".rollout-gateway-agent.pid"
AGENT_PID_FILE = f'"${{TMPDIR:-/tmp}}/{AGENT_PID_NAME}"'


def _post_script(body: str) -> str:
    """POSIX sh posting the JSON ``body`` (a shell word, may use ``$code``) to the rollout's
    exit route with whichever HTTP client the image has (curl, wget, python3); silently
    nothing if none."""
    return (
        f'b={body}; u="$OPENAI_BASE_URL/exit"; '
        'k="Bearer $OPENAI_API_KEY"; h="Authorization: $k"; '
        '{ curl -fsS -m 10 -X POST -H "$h" -H "Content-Type: application/json" -d "$b" "$u" '
        '|| wget -q -T 10 -O /dev/null --header="$h" --header="Content-Type: application/json" '
        '--post-data="$b" "$u" '
        "|| python3 -c 'import os,sys,urllib.request as r; r.urlopen(r.Request(sys.argv[1], "
        'sys.argv[2].encode(), {"Authorization": sys.argv[3], '
        '"Content-Type": "application/json"}), timeout=10)\' "$u" "$b" "$k"; '
        "} >/dev/null 2>&1"
    )


#: POSIX sh run after the agent exits: report ``$code`` to the gateway, with whichever HTTP
#: client the image has (curl, wget, python3); silently nothing if none. A hint only.
REPORT_EXIT_SCRIPT = _post_script('"{\\"exit_code\\": $code}"')

#: POSIX sh run beside the agent as it starts: tell the gateway the wrapper can report
#: the agent's exit (nothing is sent, so nothing is heard, from an image without a client).
REPORT_STARTED_SCRIPT = _post_script('\'{"exit_code": null, "started": true}\'')


def agent_launch_command(
    run_command: str, pid_file: str = AGENT_PID_FILE, *, report_exit: bool = True
) -> str:
    """``run_command`` behind a wrapper that records its pid (so it can be stopped) and,
    with ``report_exit``, reports its exit code to the gateway as soon as it exits.

    ``pid_file`` is a shell word (expanded by the sandbox's shell)."""
    if not report_exit:
        inner = f"echo $$ > {pid_file}; exec sh -c {shlex.quote(run_command)}"
    else:
        inner = (
            f"echo $$ > {pid_file}; ( {REPORT_STARTED_SCRIPT} ) </dev/null >/dev/null 2>&1 & "
            f"sh -c {shlex.quote(run_command)}; code=$?; {REPORT_EXIT_SCRIPT}; exit $code"
        )
    return f"sh -c {shlex.quote(inner)}"


def stop_agent_script(pid_file: str = AGENT_PID_FILE) -> str:
    """POSIX sh that kills the agent's process tree, each process frozen before its children
    are listed, so nothing respawns meanwhile (``/proc/PID/task/*/children``)."""
    return (
        "kt() { cs=$(cat /proc/$1/task/*/children 2>/dev/null); kill -STOP $1 2>/dev/null; "
        "for c in $cs; do kt $c; done; kill -KILL $1 2>/dev/null; }; "
        f'p=$(cat {pid_file} 2>/dev/null) && [ -n "$p" ] && kt "$p"; true'
    )


__all__ = [
    "AGENT_PID_FILE",
    "AGENT_PID_NAME",
    "REPORT_EXIT_SCRIPT",
    "REPORT_STARTED_SCRIPT",
    "agent_launch_command",
    "stop_agent_script",
]
