"""The rollout gateway protocol (v1): routes, bodies, error codes, the exit stream.

Shared by the client (:mod:`rollout_gateway.client`), the reference server
(:mod:`rollout_gateway.server`) and the fakes (:mod:`rollout_gateway.testing`), so every
side agrees on the wire format by construction. One module per part:

- :mod:`.routes`: rollout ids, route templates and the paths clients fill in;
- :mod:`.schema`: the bodies (TypedDicts) and one ``parse_*`` per body read, used by the
  server and the client alike;
- :mod:`.errors`: error codes of error answers, and :class:`~.errors.BodyError`;
- :mod:`.exit_stream`: exit reports and the exit stream's lines;
- :mod:`.delta`: the trajectory's delta form;
- :mod:`.urls`: gateway roots, hosts and the agents' base URLs.

Every public name is re-exported here (``protocol.NAME``). Imports go one way: the
package imports nothing of the gateway's.
"""

from __future__ import annotations

from rollout_gateway.protocol import delta, errors, exit_stream, routes, schema, urls
from rollout_gateway.protocol.delta import *
from rollout_gateway.protocol.errors import *
from rollout_gateway.protocol.exit_stream import *
from rollout_gateway.protocol.routes import *
from rollout_gateway.protocol.schema import *
from rollout_gateway.protocol.urls import *

__all__ = [
    *delta.__all__,
    *errors.__all__,
    *exit_stream.__all__,
    *routes.__all__,
    *schema.__all__,
    *urls.__all__,
]
