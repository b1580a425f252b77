"""Checks run before any sandbox starts, so a mistake costs a clear message, not a run."""

from __future__ import annotations

from typing import Any

import httpx

from rollout_gateway.demo.options import DemoError


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
        async with httpx.AsyncClient(timeout=10.0, transport=transport) as http:
            response = await http.get(url)
    except httpx.HTTPError as e:
        raise DemoError(f"cannot reach the upstream {base_url}: {e!r}") from None
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


__all__ = ["check_upstream"]
