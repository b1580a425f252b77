"""Which verifiers the v1 adapter accepts, and that it says so (rollout_gateway.v1.internals)."""

from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

import pytest

from rollout_gateway.v1 import SUPPORTED_VERIFIERS, TESTED_VERIFIERS, UnsupportedVerifiersError
from rollout_gateway.v1.internals import VERIFIERS_VERSION, check_verifiers, is_supported

V1_PACKAGE = Path(__file__).resolve().parents[2] / "rollout_gateway" / "v1"


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.4.0", True),
        ("0.4.0.post1", True),
        ("0.4.1.dev86", True),  # a pre-release of 0.4.1 comes after 0.4.0
        ("0.4.7", True),
        ("0.4.0.dev3", False),  # a pre-release of 0.4.0 comes before it
        ("0.4.0rc1", False),
        ("0.3.1", False),
        ("0.3.2.dev210", False),
        ("0.4.2+prime.3", True),  # a local build of a supported version
        ("0.5.0", False),
        ("0.5.0.dev1", False),  # a pre-release of 0.5 is not below 0.5
        ("a git describe", False),  # not a version: refused, not guessed at
        ("1.0.0", False),
    ],
)
def test_the_supported_range_is_0_4(version: str, supported: bool) -> None:
    assert is_supported(version) is supported


def test_an_unsupported_verifiers_fails_at_import_naming_both_versions() -> None:
    with pytest.raises(ImportError) as raised:  # what an env server's import sees
        check_verifiers("0.3.2.dev210")
    error = raised.value
    assert isinstance(error, UnsupportedVerifiersError)
    message = str(error)
    assert "verifiers 0.3.2.dev210 is installed" in message
    assert SUPPORTED_VERIFIERS in message and "0.4.0" in message


def test_the_installed_verifiers_is_a_tested_one() -> None:
    assert VERIFIERS_VERSION == metadata.version("verifiers")
    assert VERIFIERS_VERSION in TESTED_VERIFIERS


def test_every_verifiers_import_of_the_adapter_is_in_internals() -> None:
    # One module to change when verifiers moves a name (and the version check before it);
    # the demo's eval-only names in a second one, so that they cannot break the runtime.
    offenders = []
    for path in sorted(V1_PACKAGE.glob("*.py")):
        if path.name in ("internals.py", "eval_internals.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "verifiers"]
    assert offenders == [], offenders
