"""Installing the agent CLIs into the cache: once, whole or not at all, readable by the
sandboxes' own uids; and how each CLI is run."""

from __future__ import annotations

import shlex
import stat
from pathlib import Path

import pytest

from rollout_gateway.agent_clis import AGENT_CLIS, CLAUDE_CODE, CODEX, cache_root, install, main

FAKE_NPM = """#!/bin/sh
# npm install --no-audit --no-fund --no-save --prefix DIR SPEC
echo "$@" >> "{log}"
prefix="$6"
[ -n "{fail}" ] && exit 1
mkdir -p "$prefix/node_modules/.bin"
printf '#!/bin/sh\\necho fake\\n' > "$prefix/node_modules/.bin/{binary}"
chmod 700 "$prefix/node_modules/.bin/{binary}" "$prefix/node_modules"
"""


def fake_npm(tmp_path: Path, binary: str, *, fail: bool = False) -> tuple[str, Path]:
    log = tmp_path / "npm.log"
    npm = tmp_path / "npm"
    npm.write_text(FAKE_NPM.format(log=log, binary=binary, fail="1" if fail else ""))
    npm.chmod(0o755)
    return str(npm), log


def test_installs_once_at_the_pinned_version_readable_by_all(tmp_path: Path) -> None:
    npm, log = fake_npm(tmp_path, "claude")
    root = tmp_path / "cache"
    program = install(CLAUDE_CODE, root, npm=npm)
    assert program == root / "@anthropic-ai+claude-code@2.1.328/node_modules/.bin/claude"
    assert log.read_text().split()[-1] == "@anthropic-ai/claude-code@2.1.328"
    assert stat.S_IMODE(program.stat().st_mode) & 0o005 == 0o005  # other: r-x
    assert install(CLAUDE_CODE, root, npm=npm) == program
    assert len(log.read_text().splitlines()) == 1  # the second call installed nothing
    assert [p.name for p in root.iterdir()] == [program.parents[2].name]  # no staging left


def test_a_failed_install_leaves_nothing_that_looks_installed(tmp_path: Path) -> None:
    npm, _ = fake_npm(tmp_path, "codex", fail=True)
    root = tmp_path / "cache"
    with pytest.raises(Exception, match="exit status 1"):
        install(CODEX, root, npm=npm)
    assert CODEX.executable(root) is None
    assert list(root.iterdir()) == []


def test_the_cache_follows_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_GATEWAY_AGENT_CLIS", str(tmp_path))
    assert cache_root() == tmp_path
    assert CODEX.executable() is None
    assert "python -m rollout_gateway.agent_clis install codex" in CODEX.install_hint()
    with pytest.raises(SystemExit):
        main(["install", "cursor"])


def test_each_command_turns_the_clis_extra_traffic_off_and_names_the_rollout() -> None:
    claude = shlex.split(CLAUDE_CODE.command("/c/claude", "PROMPT"))
    assert "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1" in claude
    assert "DISABLE_AUTOUPDATER=1" in claude
    assert claude[claude.index("/c/claude") :][:3] == ["/c/claude", "-p", "PROMPT"]
    codex = shlex.split(CODEX.command("/c/codex", "PROMPT"))
    for flag in ("check_for_update_on_startup=false", "analytics.enabled=false"):
        assert codex[codex.index(flag) - 1] == "-c"
    provider = next(word for word in codex if word.startswith("model_providers.gateway="))
    assert 'base_url="$OPENAI_BASE_URL"' in provider and 'wire_api="responses"' in provider
    assert set(AGENT_CLIS) == {"claude-code", "codex"}
