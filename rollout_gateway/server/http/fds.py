"""File descriptors: the gateway's connection caps, derived from the process's limit.

Every connection is a file descriptor: an agent's, and the upstream connection its turn
holds. A process may have ``RLIMIT_NOFILE`` of them (often 1024, 256 on some hosts); at
the limit, ``accept`` fails with ``EMFILE`` and new connections wait in the kernel's
backlog until they are reset, while the gateway's own connection cap (4096 by default)
is never reached, so its eviction of idle connections never runs. With a limit of 256,
300 idle half-sent connections made ``/health`` and register fail.

:func:`plan_fds` splits the limit: :data:`RESERVED_FDS` for the gateway's own files
(listening sockets, the event loop, logs, a tokenizer's files), a third of the rest for
upstream connections (each upstream's pools), the remainder for agents' connections.
Below the agents' cap, the HTTP server (:mod:`.connections`) closes the connection idle
longest (silent or half-sent first) to let a new one in, so ``/health``, the control
plane and agents that send their requests get in under a flood. A cap asked for
explicitly that the limit cannot hold is refused at start-up.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

#: File descriptors kept for everything but connections.
RESERVED_FDS = 64
#: Agents' connections at most when the limit is generous.
DEFAULT_MAX_CONNECTIONS = 4096
#: Fewest agents' connections a gateway may be left with: below this, the limit is too
#: low to run (each agent holds one or two, an env's exit stream one).
MIN_AGENT_CONNECTIONS = 32
#: The soft limit is raised to the hard one at most this far (``serve`` only).
_RAISE_TO_AT_MOST = 1 << 20


@dataclass(frozen=True)
class FdPlan:
    """How a gateway shares its file descriptors (see the module docstring)."""

    #: The process's limit the plan was made for.
    nofile: int
    #: Agents' (and the control plane's) connections at most.
    agent_connections: int
    #: Connections of each upstream connection pool at most.
    upstream_connections: int


def fd_limit() -> int:
    """The process's soft ``RLIMIT_NOFILE`` (a large number when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _RAISE_TO_AT_MOST if soft == resource.RLIM_INFINITY else soft


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (at most 2**20), as servers
    commonly do at start; returns the soft limit in effect. Only for a process that
    only serves (``rollout-gateway serve``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _RAISE_TO_AT_MOST if hard == resource.RLIM_INFINITY else hard
    target = min(target, _RAISE_TO_AT_MOST)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return fd_limit()


def plan_fds(
    nofile: int, *, max_connections: int | None, per_upstream_pool: int, upstream_pools: int
) -> FdPlan:
    """Split ``nofile`` file descriptors (see the module docstring).

    Args:
        nofile: the process's limit.
        max_connections: agents' connections asked for (``None``: as many as the limit
            leaves, at most :data:`DEFAULT_MAX_CONNECTIONS`).
        per_upstream_pool: connections asked for per upstream pool.
        upstream_pools: upstream connection pools in all.

    Raises ``ValueError`` (naming ``--max-connections`` and ``ulimit -n``) when the limit
    cannot hold what was asked, or leaves fewer than :data:`MIN_AGENT_CONNECTIONS`.
    """
    usable = nofile - RESERVED_FDS
    pools = max(1, upstream_pools)
    per_pool = max(1, min(per_upstream_pool, (max(usable, 0) // 3) // pools))
    room = usable - per_pool * pools
    if max_connections is None:
        agents = min(DEFAULT_MAX_CONNECTIONS, room)
    elif max_connections > room:
        raise ValueError(
            f"--max-connections {max_connections}: the file-descriptor limit "
            f"(RLIMIT_NOFILE {nofile}) holds at most {max(room, 0)} connections after "
            f"{RESERVED_FDS} reserved and {per_pool * pools} for upstream connections; "
            "raise it (ulimit -n) or ask for fewer"
        )
    else:
        agents = max_connections
    if max_connections is None and agents < MIN_AGENT_CONNECTIONS:
        raise ValueError(
            f"the file-descriptor limit (RLIMIT_NOFILE {nofile}) is too low to serve: it "
            f"leaves {max(room, 0)} connections (at least {MIN_AGENT_CONNECTIONS} needed "
            f"after {RESERVED_FDS} reserved and {per_pool * pools} for upstream "
            "connections); raise it (ulimit -n)"
        )
    return FdPlan(nofile, agents, per_pool)


__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "MIN_AGENT_CONNECTIONS",
    "RESERVED_FDS",
    "FdPlan",
    "fd_limit",
    "plan_fds",
    "raise_fd_limit",
]
