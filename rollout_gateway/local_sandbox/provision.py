"""Provisioning a sandbox on the host: its uid, directories, disk, cgroups and image.

What a :class:`~rollout_gateway.local_sandbox.sandbox.LocalSandbox` owns on the host is
made here, in one blocking call (run in a thread), and recorded on the sandbox itself so
that its destruction (:mod:`~rollout_gateway.local_sandbox.registry`) removes it all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_gateway.local_sandbox import cgroups, disks, layout, uids
from rollout_gateway.local_sandbox.sandbox import LocalSandbox
from rollout_gateway.local_sandbox.seeding import local_image_path, seed


def provision(sb: LocalSandbox, root: Path, *, enforce_limits: bool, traversable: bool) -> None:
    """Make everything ``sb`` owns on the host (blocking).

    ``enforce_limits``: give it a disk of its own and cgroups where the host offers them;
    ``traversable``: its directories may be entered by its own uid (the uid modes).
    An image that cannot be used leaves the sandbox in status ``ERROR``.
    """
    if sb.mode.uses_sandbox_uid:
        sb.lease = uids.claim_uid()
    meta: dict[str, Any] = {"mode": str(sb.mode), "uid": sb.lease.uid if sb.lease else None}
    mount = _disk_mount(sb, root) if enforce_limits else None
    sb.lock_fd = layout.create_dirs(sb.dirs, sb.owner, meta, traversable, mount)
    if enforce_limits:
        _add_cgroup(sb, meta)
    _seed_image(sb)


def _disk_mount(sb: LocalSandbox, root: Path) -> Callable[[Path], None] | None:
    """How to give the sandbox a disk of its own size, or ``None`` where there is none."""
    disk_bytes = sb.limits.disk_bytes
    if not disk_bytes or disks.availability() is not None:
        return None
    image = layout.disk_image(root, sb.id)

    def mount(base: Path) -> None:
        disks.create(image, base, disk_bytes)
        sb.disk_image = image

    return mount


def _add_cgroup(sb: LocalSandbox, meta: dict[str, Any]) -> None:
    """Put the sandbox under cgroups of its own where the host has a hierarchy for it."""
    found = cgroups.hierarchy()
    if not isinstance(found, cgroups.Hierarchy):
        return
    sb.cgroup = cgroups.SandboxCgroup.create(
        found,
        sb.id,
        memory_bytes=sb.limits.memory_bytes,
        pids=sb.limits.pids,
        cpu_cores=sb.limits.cpu_cores,
    )
    # Where the stale sweep finds them should this process die (they may sit under this
    # process's own group, which another process does not know).
    meta["cgroups"] = sb.cgroup.paths()
    layout.write_meta(sb.dirs, meta)


def _seed_image(sb: LocalSandbox) -> None:
    """Fill the working directory from the local image the request names, if any."""
    source = local_image_path(sb.request.docker_image)
    if source is None:
        return
    error = seed(source, sb.work)
    if error is not None:
        sb.status, sb.error_type = "ERROR", "IMAGE_PULL_FAILED"
        sb.error_message = f"Cannot use local image {sb.request.docker_image!r}: {error}"
    elif sb.owner is not None:
        layout.chown_tree(sb.work, sb.owner)


__all__ = ["provision"]
