"""The real agent CLIs the gateway is tested and demonstrated with: Claude Code (Anthropic
Messages) and Codex (OpenAI Responses), installed from npm once per machine.

Each CLI is installed at its pinned version into its own directory of a cache outside any
checkout (:func:`cache_root`: ``$ROLLOUT_GATEWAY_AGENT_CLIS``, default
``~/.cache/rollout-gateway/agent-clis``), made world-readable so contained sandboxes can
run it from a read-only mount. ``python -m rollout_gateway.agent_clis install`` installs
both (CI does, in ``.ci/run``); the tests and ``rollout-gateway demo --agent`` find them
with :meth:`AgentCli.executable`.

How each is run against a rollout (:meth:`AgentCli.command`): the task's prompt, the
model's variables from the agent's environment (``ANTHROPIC_*`` for Claude Code; Codex
reads no base URL variable, so its command names a provider on ``$OPENAI_BASE_URL`` /
``OPENAI_API_KEY``), and the CLI's non-essential traffic (telemetry, update checks,
error reports, feedback) turned off by its documented switches (:attr:`AgentCli.quiet`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Overrides the cache directory of :func:`cache_root`.
CACHE_ENV_VAR = "ROLLOUT_GATEWAY_AGENT_CLIS"

#: Codex's provider for the rollout: Responses on ``$OPENAI_BASE_URL`` with the key in
#: ``OPENAI_API_KEY``; no retries of its own (a refusal is final, as the gateway means it).
#: (Inside a double-quoted shell word, so that ``$OPENAI_BASE_URL`` expands.)
_CODEX_PROVIDER = (
    r"model_providers.gateway={name=\"gateway\",base_url=\"$OPENAI_BASE_URL\","
    r"env_key=\"OPENAI_API_KEY\",wire_api=\"responses\",stream_max_retries=0,"
    r"request_max_retries=0}"
)
#: Codex's switches for what it would send elsewhere (its config.toml keys). Without
#: ``features.plugins=false`` Codex 0.169 syncs its curated plugins at startup (DNS and
#: HTTPS to api.github.com and chatgpt.com: seen with strace, tests/agent_clis).
_CODEX_QUIET = (
    "check_for_update_on_startup=false",
    "analytics.enabled=false",
    "feedback.enabled=false",
    "features.plugins=false",
)


@dataclass(frozen=True)
class AgentCli:
    """One agent CLI: its npm package at the pinned version, and how it runs a task."""

    name: str
    package: str
    version: str
    binary: str
    dialect: str
    #: Variables that turn off the CLI's non-essential network traffic (documented).
    quiet: dict[str, str] = field(default_factory=dict)

    @property
    def spec(self) -> str:
        """``package@version``, what npm installs."""
        return f"{self.package}@{self.version}"

    def install_dir(self, root: Path | None = None) -> Path:
        """The CLI's directory in the cache (``npm --prefix``)."""
        return (root or cache_root()) / self.spec.replace("/", "+")

    def executable(self, root: Path | None = None) -> Path | None:
        """The installed CLI's program, or ``None`` when it is not installed."""
        path = self.install_dir(root) / "node_modules" / ".bin" / self.binary
        return path if path.exists() else None

    def install_hint(self) -> str:
        """One line: how to install this CLI where the gateway's tools look for it."""
        return (
            f"{self.name} ({self.spec}) is not installed: python -m rollout_gateway.agent_clis "
            f"install {self.name} (needs npm; into {self.install_dir()})"
        )

    def command(self, program: str, prompt: str) -> str:
        """A shell command running ``program`` (this CLI) on the task ``prompt`` (a shell
        word, e.g. ``"$(cat task.md)"``) against the rollout named by the agent's
        variables, with its own tools allowed and its extra traffic off."""
        quiet = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(self.quiet.items()))
        if self.name == "claude-code":
            # IS_SANDBOX: Claude Code refuses bypassPermissions as root unless told it runs
            # in a sandbox (it does). The model comes from ANTHROPIC_MODEL.
            return (
                f"{quiet}IS_SANDBOX=1 {shlex.quote(program)} -p {prompt} "
                "--permission-mode bypassPermissions --output-format text"
            )
        flags = " ".join(f"-c {shlex.quote(flag)}" for flag in _CODEX_QUIET)
        return (
            f"{quiet}{shlex.quote(program)} exec --skip-git-repo-check "
            f"--dangerously-bypass-approvals-and-sandbox {flags} "
            f'-c "{_CODEX_PROVIDER}" -c model_provider=gateway -m "$OPENAI_MODEL" '
            f"{prompt} < /dev/null"
        )


CLAUDE_CODE = AgentCli(
    name="claude-code",
    package="@anthropic-ai/claude-code",
    version="2.1.328",
    binary="claude",
    dialect="anthropic",
    quiet={
        # Covers DISABLE_AUTOUPDATER, DISABLE_BUG_COMMAND, DISABLE_ERROR_REPORTING and
        # DISABLE_TELEMETRY (Claude Code's settings documentation); named too, for clarity.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    },
)
CODEX = AgentCli(
    name="codex",
    package="@openai/codex",
    version="0.169.0",
    binary="codex",
    dialect="responses",
    # Codex's switches are config keys (``-c`` in its command: ``_CODEX_QUIET``); with
    # no login there is no token refresh.
)
#: The CLIs by name.
AGENT_CLIS: dict[str, AgentCli] = {cli.name: cli for cli in (CLAUDE_CODE, CODEX)}


def cache_root() -> Path:
    """Where the CLIs are installed: ``$ROLLOUT_GATEWAY_AGENT_CLIS``, else
    ``~/.cache/rollout-gateway/agent-clis``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "rollout-gateway" / "agent-clis"


def readable_by_all(path: Path) -> None:
    """Let any uid (a sandbox's own) read and run what was installed under ``path``
    (``a+rX``), symlinks left alone: the agent CLIs' cache, and the harness cache's."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            entry = Path(dirpath) / name
            if entry.is_symlink():
                continue
            mode = entry.stat().st_mode
            extra = 0o555 if entry.is_dir() or mode & 0o111 else 0o444
            if mode & extra != extra:
                entry.chmod(mode | extra)
    path.chmod(path.stat().st_mode | 0o555)


def install(cli: AgentCli, root: Path | None = None, *, npm: str = "npm") -> Path:
    """Install ``cli`` into the cache unless it is there; returns its program.

    npm installs into a fresh directory beside the final one, renamed into place when
    complete, so an interrupted install never looks installed.
    """
    found = cli.executable(root)
    if found is not None:
        return found
    if shutil.which(npm) is None:
        raise RuntimeError(f"npm not found: {cli.install_hint()}")
    final = cli.install_dir(root)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(staging)]
            + [cli.spec],
            check=True,
            stdout=sys.stderr,
        )
        readable_by_all(staging)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    program = cli.executable(root)
    if program is None:
        raise RuntimeError(f"npm installed {cli.spec} without its {cli.binary!r} program")
    return program


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rollout_gateway.agent_clis install|where|path [NAME ...]``: install
    (each not yet installed), say where each is, or print one's program alone (exit 1
    when it is not installed)."""
    parser = argparse.ArgumentParser(
        prog="python -m rollout_gateway.agent_clis",
        description=f"Install the agent CLIs (npm) into {cache_root()} (${CACHE_ENV_VAR}).",
    )
    parser.add_argument("action", choices=("install", "where", "path"))
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(AGENT_CLIS)}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in AGENT_CLIS]
    if unknown:
        parser.error(f"no agent CLI {unknown[0]!r}: {', '.join(AGENT_CLIS)}")
    if args.action == "path":
        if len(args.names) != 1:
            parser.error("path: name one CLI")
        cli = AGENT_CLIS[args.names[0]]
        program = cli.executable()
        if program is None:
            print(cli.install_hint(), file=sys.stderr)
            return 1
        print(program)
        return 0
    for name in args.names or list(AGENT_CLIS):
        cli = AGENT_CLIS[name]
        program = install(cli) if args.action == "install" else cli.executable()
        print(f"{cli.name} {cli.version}: {program or 'not installed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "AGENT_CLIS",
    "CACHE_ENV_VAR",
    "CLAUDE_CODE",
    "CODEX",
    "AgentCli",
    "cache_root",
    "install",
    "main",
]
