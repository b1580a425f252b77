"""Fakes for the seams of an env in gateway mode, for tests of env code.

- :class:`~.gateway.FakeGateway`: the reference gateway itself (its app on the memory
  store, in this process) as an httpx transport (pass ``gateway.transport()`` as
  ``GatewaySettings(transport=...)``), with failures, latency and a gateway without the
  protocol's extensions injected at the transport;
- :class:`~.sandboxes.FakeSandboxClient`: what ``CliAgentEnv`` calls on its sandbox
  client, with an *agent* coroutine standing in for the sandboxed process, latencies and
  failure injection (prime-sandboxes' types made only when used);
- :class:`~.tunnels.FakeTunnelProvider`: counts tunnel starts, can be slow, fail or die;
- :func:`~.rows.task_row`: an input row in verifiers' format.

They hold no network resource; nothing here is used by the package at run time.
"""

from __future__ import annotations

from rollout_gateway.testing import gateway, rows, sandboxes, tunnels
from rollout_gateway.testing.gateway import *
from rollout_gateway.testing.rows import *
from rollout_gateway.testing.sandboxes import *
from rollout_gateway.testing.tunnels import *

__all__ = [*gateway.__all__, *rows.__all__, *sandboxes.__all__, *tunnels.__all__]
