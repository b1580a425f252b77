"""Local sandboxes with prime-sandboxes' client interface, containing an untrusted agent.

- :mod:`~rollout_gateway.local_sandbox.client`: :class:`LocalSandboxClient`, the facade the
  mixin and ``vf.CliAgentEnv`` use (same methods, models and errors as prime-sandboxes).
- :mod:`~rollout_gateway.local_sandbox.isolation`: the isolation modes (``bwrap`` >
  ``unshare`` > ``uid``; ``process-group`` only on explicit opt-in) and their command lines.
- :mod:`~rollout_gateway.local_sandbox.processes`: spawning, waiting, killing.
- :mod:`~rollout_gateway.local_sandbox.uids`: per-sandbox uids (root hosts).
- :mod:`~rollout_gateway.local_sandbox.registry`: the client's sandboxes, their
  destruction and the reaper of expired ones.
- :mod:`~rollout_gateway.local_sandbox.commands`: ``execute_command`` and background jobs.
- :mod:`~rollout_gateway.local_sandbox.files` / ``file_api``: the file API, which never
  follows a path out of the sandbox.
- :mod:`~rollout_gateway.local_sandbox.layout`: directories, ownership, the stale sweep.
- :mod:`~rollout_gateway.local_sandbox.tools`: where ``bwrap`` and util-linux come from.
- :mod:`~rollout_gateway.local_sandbox.errors`: what the host cannot do.

prime-sandboxes remains the backend for real training.
"""

from rollout_gateway.local_sandbox.client import ROOT_ENV_VAR, LocalSandboxClient, default_root
from rollout_gateway.local_sandbox.errors import (
    IsolationUnavailableError,
    LocalSandboxError,
    SandboxRootError,
)
from rollout_gateway.local_sandbox.isolation import (
    FALLBACK_ORDER,
    ISOLATION_ENV_VAR,
    IsolationMode,
    available_modes,
    choose_mode,
    unavailable_reasons,
)
from rollout_gateway.local_sandbox.processes import MARKER_ENV_VAR

__all__ = [
    "FALLBACK_ORDER",
    "ISOLATION_ENV_VAR",
    "MARKER_ENV_VAR",
    "ROOT_ENV_VAR",
    "IsolationMode",
    "IsolationUnavailableError",
    "LocalSandboxClient",
    "LocalSandboxError",
    "SandboxRootError",
    "available_modes",
    "choose_mode",
    "default_root",
    "unavailable_reasons",
]
