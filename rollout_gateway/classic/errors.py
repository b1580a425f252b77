"""The core's errors on verifiers 0.3's error model (the ``vf.InfraError`` family).

A trainer on verifiers 0.3 reschedules a rollout whose ``state["error"]`` is a
``vf.InfraError``. :func:`to_vf_error` turns a core error into an instance of a class
that subclasses both the core class (so ``except rollout_gateway.GatewayError`` still
matches) and the matching verifiers class: ``vf.TunnelError`` for tunnel failures,
``vf.SandboxError`` for sandbox failures, ``CliAgentEnv``'s own ``AgentError`` (an
``InfraError``) for an agent that crashed, ``vf.ModelError`` and ``vf.InfraError`` for an
engine outage behind the gateway (:class:`~rollout_gateway.errors.EngineError`),
``vf.InfraError`` for the rest.
"""

from __future__ import annotations

import verifiers as vf
from verifiers.envs.experimental.cli_agent_env import AgentError

from rollout_gateway import errors as core


def _vf_bases(cls: type[BaseException]) -> tuple[type[vf.Error], ...]:
    if issubclass(cls, core.EngineError):
        # CliAgentEnv's own interception records a failed model call as vf.ModelError;
        # an InfraError too, so a trainer reschedules it (an outage, not the policy).
        return (vf.ModelError, vf.InfraError)
    return (_vf_base(cls),)


def _vf_base(cls: type[BaseException]) -> type[vf.Error]:
    if issubclass(cls, core.AgentCrashError):
        return AgentError
    if issubclass(cls, core.GatewayTunnelError):
        return vf.TunnelError
    if issubclass(cls, core.SandboxError):
        return vf.SandboxError
    if issubclass(cls, core.RolloutInfraError):
        return vf.InfraError
    return vf.Error


_VF_CLASSES: dict[type[BaseException], type[BaseException]] = {}


def vf_error_class(cls: type[BaseException]) -> type[BaseException]:
    """The class subclassing both ``cls`` (a core error class) and its verifiers match."""
    vf_cls = _VF_CLASSES.get(cls)
    if vf_cls is None:
        namespace = {"__module__": cls.__module__, "__doc__": cls.__doc__}
        vf_cls = _VF_CLASSES[cls] = type(cls.__name__, (cls, *_vf_bases(cls)), namespace)
    return vf_cls


def to_vf_error(error: BaseException) -> BaseException:
    """``error`` as verifiers 0.3 expects it on ``state["error"]`` (``vf.Error`` kept as is)."""
    if isinstance(error, vf.Error) or not isinstance(error, core.RolloutGatewayError):
        if isinstance(error, vf.Error):
            return error
        converted = vf.InfraError(f"{type(error).__name__}: {error}")
        converted.__cause__ = error
        return converted
    cls = vf_error_class(type(error))
    converted = cls.__new__(cls)
    converted.args = error.args
    converted.__dict__.update(error.__dict__)
    converted.__cause__ = error.__cause__
    converted.__traceback__ = error.__traceback__
    return converted


__all__ = ["to_vf_error", "vf_error_class"]
