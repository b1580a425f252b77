"""The local sandbox backend's own errors (what the host cannot do), apart from the
prime-sandboxes errors its client raises for its API's failures."""

from __future__ import annotations


class LocalSandboxError(RuntimeError):
    """Local sandboxes cannot run here as asked; the message says what to do."""


class IsolationUnavailableError(LocalSandboxError):
    """The requested isolation mode (or, for ``auto``, every contained mode) is
    unavailable on this host.

    Attributes:
        mode: the mode asked for (``auto`` included).
        reasons: each mode tried -> why this host does not offer it.
    """

    def __init__(self, message: str, *, mode: str, reasons: dict[str, str] | None = None):
        super().__init__(message)
        self.mode = mode
        self.reasons = dict(reasons or {})


class SandboxRootError(LocalSandboxError):
    """The sandbox root cannot be used (not creatable, not writable, or not reachable by
    the sandboxes' uids).

    Attributes:
        root: the directory.
    """

    def __init__(self, message: str, *, root: str) -> None:
        super().__init__(message)
        self.root = root


__all__ = ["IsolationUnavailableError", "LocalSandboxError", "SandboxRootError"]
