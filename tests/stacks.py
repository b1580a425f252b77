"""Which verifiers stack this test run has, and the tests that need the other one.

CI runs the suite twice, in one virtualenv per stack (``.ci/run``): ``classic``
(``rollout-gateway[classic]``, verifiers 0.3) and ``v1`` (``rollout-gateway[v1]``,
verifiers 0.4). Common tests (the core: protocol, client, tunnels, lifecycle, server,
scripted model) run in both; each stack's own tests are not collected in the other
venv, where their imports cannot resolve.
"""

from __future__ import annotations

from importlib import metadata


def detect_stack() -> str:
    """``"v1"`` with verifiers 0.4+, ``"classic"`` with verifiers 0.3, ``"none"`` without."""
    try:
        version = metadata.version("verifiers")
    except metadata.PackageNotFoundError:
        return "none"
    major, minor = (int(part) for part in version.split(".")[:2])
    return "v1" if (major, minor) >= (0, 4) else "classic"


STACK = detect_stack()

#: Paths (relative to ``tests/``) that need the verifiers 0.3 stack: its adapter, its
#: example env and demo, and modules using the classic fixtures of ``helpers.py``.
CLASSIC_ONLY = [
    "classic",
    "examples",
    "test_demo_classic.py",
    "test_integration_gateway.py",
    "test_client.py",
    "test_soak.py",  # its env processes run the classic example env
    "local_sandbox/test_local_sandbox.py",
    "real_engine/test_classic_stack.py",
]

#: Paths (relative to ``tests/``) that need the verifiers 0.4 stack.
V1_ONLY = [
    "v1",
    "test_demo_v1.py",
    "real_engine/test_v1_stack.py",
    "server/dialects/test_v1_parity.py",
]


def ignored_paths() -> list[str]:
    """The test paths the current stack cannot collect."""
    if STACK == "v1":
        return list(CLASSIC_ONLY)
    if STACK == "classic":
        return list(V1_ONLY)
    return [*CLASSIC_ONLY, *V1_ONLY]
