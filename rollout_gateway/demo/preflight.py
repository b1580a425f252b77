"""Checks run before anything is created, so a mistake costs a clear message, not a run:
the upstream answers as an OpenAI-compatible API serving the model, and the local
sandboxes can contain an agent on this host."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import httpx

from rollout_gateway.demo.options import DemoError

#: Seconds to wait for the upstream's ``/models``: a dead address answers at once (refused)
#: or never (filtered); neither should hold the demo long.
UPSTREAM_CHECK_TIMEOUT = httpx.Timeout(10.0, connect=5.0)

#: The warning printed for ``--isolation process-group`` (no containment).
UNCONTAINED_WARNING = (
    "warning: --isolation process-group: agents run WITHOUT containment, as your user, "
    "with your files, network and environment in reach; use it only for agents you trust"
)


async def check_upstream(
    base_url: str, model: str, *, transport: httpx.AsyncBaseTransport | None = None
) -> None:
    """Make sure ``base_url`` is an OpenAI-compatible API that serves ``model``.

    Asks ``GET {base_url}/models`` (every OpenAI-compatible server answers it) and raises
    :class:`DemoError` saying what is wrong: unreachable, up but not an OpenAI-compatible
    API (a 404 or a non-JSON answer, e.g. the gateway's own root or a web server), or a
    model the server does not list.
    """
    url = f"{base_url.rstrip('/')}/models"
    try:
        async with httpx.AsyncClient(timeout=UPSTREAM_CHECK_TIMEOUT, transport=transport) as http:
            response = await http.get(url)
    except httpx.HTTPError as e:
        reason = str(e) or type(e).__name__
        raise DemoError(f"cannot reach the upstream {base_url}: {reason}") from None
    if response.status_code in (401, 403):
        raise DemoError(
            f"the upstream {base_url} refused GET /models (HTTP {response.status_code}): "
            "it needs an API key"
        )
    body: Any = None
    if response.status_code == 200:
        try:
            body = response.json()
        except ValueError:
            body = None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        hint = " (is the URL missing its /v1?)" if not base_url.rstrip("/").endswith("/v1") else ""
        raise DemoError(
            f"{base_url} is up but is not an OpenAI-compatible API: GET {url} answered "
            f"HTTP {response.status_code} without a model list{hint}"
        )
    served = [m.get("id") for m in data if isinstance(m, dict)]
    if model not in served:
        raise DemoError(
            f"the upstream {base_url} does not serve model {model!r}; it serves: "
            + (", ".join(str(s) for s in served) or "no models")
        )


def reachable_by_others(path: str) -> bool:
    """Whether an unprivileged user can reach ``path``'s real location."""
    real = Path(os.path.realpath(path))
    return all(os.stat(parent).st_mode & 0o001 for parent in real.parents)


def probe_isolation(requested: str) -> str:
    """The local sandbox mode ``requested`` resolves to on this host, checked usable.

    ``DemoError`` (one line) when the mode is unavailable, or when it runs the agent as a
    per-sandbox uid that cannot run this Python (a parent directory only its owner can
    search, as with a pyenv under a 0700 home)."""
    from rollout_gateway.local_sandbox import IsolationUnavailableError, choose_mode

    try:
        mode = choose_mode(requested)
    except IsolationUnavailableError as e:
        raise DemoError(" ".join(str(e).split())) from None
    if (
        mode.uses_sandbox_uid
        and not mode.has_mount_namespace_view
        and not reachable_by_others(sys.executable)
    ):
        raise DemoError(
            f"isolation {mode} runs the agent as an unprivileged uid, which cannot run this "
            f"Python ({os.path.realpath(sys.executable)}: a parent directory is not "
            "searchable by others); use --isolation bwrap (bubblewrap) or a Python "
            "installed outside such a directory"
        )
    return str(mode)


__all__ = [
    "UNCONTAINED_WARNING",
    "check_upstream",
    "probe_isolation",
    "reachable_by_others",
]
