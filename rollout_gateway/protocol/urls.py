"""Gateway URLs as envs, tunnels and agents see them: roots, hosts, ports, base URLs."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def gateway_root(base_url: str) -> str:
    """Gateway root from an OpenAI-style base URL: strip a trailing ``/`` and ``/v1``.

    ``http://h:8000/v1`` and ``http://h:8000/v1/`` give ``http://h:8000``; a URL
    without ``/v1`` is returned without its trailing slash.
    """
    url = base_url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def gateway_host(url: str) -> str:
    """The host name of a gateway URL (what a tunnel's ``local_addr`` names)."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"gateway URL {url!r} has no host")
    return host


def replace_port(url: str, port: int) -> str:
    """``url`` with its port replaced by ``port`` (scheme, host and path kept)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{port}"
    if parts.username:
        auth = parts.username + (f":{parts.password}" if parts.password else "")
        netloc = f"{auth}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def rollout_base_url(public_root: str, rollout_id: str) -> str:
    """The agent's OpenAI base URL: the SDK appends ``/chat/completions`` to it."""
    return f"{public_root.rstrip('/')}/v1/rollouts/{rollout_id}"


__all__ = ["gateway_host", "gateway_root", "replace_port", "rollout_base_url"]
