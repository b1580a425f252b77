"""What ``rollout_gateway`` shows as its public API, and the errors that name the extra
an installation lacks (another verifiers stack's adapter, the demo on a core install)."""

from __future__ import annotations

import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest
from core_only import core_only_python
from stacks import STACK

import rollout_gateway
from rollout_gateway.verifiers_stack import install_command

#: Exports that need the classic stack (verifiers 0.3).
CLASSIC_ONLY = {"RolloutGatewayMixin"}


def test_the_public_api_is_the_type_checking_imports() -> None:
    # The TYPE_CHECKING imports of rollout_gateway/__init__.py: type checkers read them,
    # the lazy imports are made of them, and __all__ (a literal, for the API reference's
    # generator, which reads it without running the module) names each of them.
    exports = rollout_gateway._exports()
    assert sorted(rollout_gateway.__all__) == sorted(["__version__", *exports])
    assert len(set(rollout_gateway.__all__)) == len(rollout_gateway.__all__)
    assert exports["GatewayClient"] == "rollout_gateway.client"
    assert exports["RolloutGatewayMixin"] == "rollout_gateway.classic.mixin"


def test_dir_lists_the_exports_this_installation_can_import() -> None:
    listed = {name for name in dir(rollout_gateway) if not name.startswith("_")}
    expected = set(rollout_gateway._exports())
    if STACK != "classic":
        expected -= CLASSIC_ONLY
    assert listed == expected
    for name in listed:
        assert getattr(rollout_gateway, name) is not None


def test_help_shows_every_importable_class_with_its_docstring() -> None:
    text = pydoc.render_doc(rollout_gateway, renderer=pydoc.plaintext)
    classes = set(re.findall(r"^    class (\w+)", text, re.MULTILINE))
    importable = {n for n in dir(rollout_gateway) if isinstance(getattr(rollout_gateway, n), type)}
    assert importable <= classes
    assert "GatewaySettings" in classes and "GatewayClient" in classes
    assert "How an env talks to the rollout gateway" in text  # GatewaySettings' docstring
    assert "RolloutGatewayMixin" in text  # named in the module's docstring on any stack


def _python(code: str, python: str | Path = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout + done.stderr).strip().splitlines()[-1]


@pytest.mark.skipif(STACK != "classic", reason="needs the classic stack")
def test_rollout_gateway_v1_on_the_classic_stack_names_the_extra() -> None:
    done = _python("import rollout_gateway.v1")
    assert done.returncode == 1
    assert _last_line(done) == (
        "rollout_gateway.verifiers_stack.WrongStackError: rollout_gateway.v1 needs the v1 "
        "stack (verifiers 0.4); this environment has verifiers 0.3.1. Install it with: "
        f"{install_command('v1')} in a virtualenv of its own (the [v1] and [classic] "
        "extras exclude each other); on verifiers 0.3 use rollout_gateway.RolloutGatewayMixin"
    )


@pytest.mark.skipif(STACK != "v1", reason="needs the v1 stack")
def test_the_mixin_on_the_v1_stack_names_the_extra() -> None:
    done = _python("from rollout_gateway import RolloutGatewayMixin")
    assert done.returncode == 1
    assert _last_line(done) == (
        "rollout_gateway.verifiers_stack.WrongStackError: rollout_gateway.RolloutGatewayMixin "
        "needs the classic stack (verifiers 0.3); this environment has verifiers 0.4.0. "
        f"Install it with: {install_command('classic')} in a virtualenv of its own "
        "(the [classic] and [v1] extras exclude each other); on verifiers 0.4 use "
        "rollout_gateway.v1"
    )
    done = _python("import rollout_gateway.classic")
    assert "needs the classic stack (verifiers 0.3)" in _last_line(done)


# ------------------------------------------------------- pip install rollout-gateway


@pytest.fixture(scope="module")
def core_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return core_only_python(tmp_path_factory.mktemp("core"))


def test_core_install_imports_the_core_and_names_the_extra_of_the_rest(core_python: Path) -> None:
    assert _last_line(_python("import verifiers", core_python)).startswith("ModuleNotFoundError")
    done = _python(
        "import rollout_gateway as r; print(sorted(n for n in dir(r) if 'Mixin' in n"
        " or 'Local' in n)); from rollout_gateway import GatewaySettings, GatewayClient",
        core_python,
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
    done = _python("import rollout_gateway.v1", core_python)
    assert _last_line(done).endswith(
        "rollout_gateway.v1 needs the v1 stack (verifiers 0.4); this environment has no "
        f"verifiers. Install it with: {install_command('v1')}"
    )
    done = _python("from rollout_gateway import RolloutGatewayMixin", core_python)
    assert f"Install it with: {install_command('classic')}" in _last_line(done)
    done = _python("from rollout_gateway import LocalSandboxClient", core_python)
    assert _last_line(done) == (
        "ImportError: rollout_gateway.LocalSandboxClient needs prime-sandboxes (its request, "
        "answer and error types), which comes with either verifiers stack: pip install "
        "'rollout-gateway[v1]' (or 'rollout-gateway[classic]')"
    )
    assert _python("import pydoc, rollout_gateway; pydoc.render_doc(rollout_gateway)", core_python)


@pytest.mark.parametrize("argv", [["demo"], ["demo", "--examples", "2"], ["demo", "--help"]])
def test_core_install_demo_says_which_extra_it_needs_and_leaves_nothing(
    core_python: Path, tmp_path: Path, argv: list[str]
) -> None:
    done = subprocess.run(
        [str(core_python), "-m", "rollout_gateway.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    flat = " ".join(output.split())  # help text wraps its lines
    assert install_command("v1") in flat and install_command("classic") in flat
    if argv[-1] == "--help":
        assert done.returncode == 0
    else:
        assert done.returncode == 2
        assert done.stderr.strip() == (
            "rollout-gateway demo: error: the demo runs an example env of verifiers, which "
            "this install lacks (core only: the gateway server and the scripted model). "
            f"Install a verifiers stack, one per virtualenv: {install_command('v1')} "
            f"(verifiers 0.4) or {install_command('classic')} (verifiers 0.3)"
        )
    assert list(tmp_path.iterdir()) == []  # no outputs/ directory, nothing at all


def test_core_install_serves_the_gateway(core_python: Path) -> None:
    done = subprocess.run(
        [str(core_python), "-m", "rollout_gateway.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--create-admin-token" in done.stdout
