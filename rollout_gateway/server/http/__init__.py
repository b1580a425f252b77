"""HTTP transport and its limits: what every request passes before the gateway reads it.

The server's connection limits (:mod:`.connections`), the outermost ASGI layer
(:mod:`.guard`), the lean path of the agents' chat routes (:mod:`.dispatch`), credentials
(:mod:`.auth`), bounded body reads and error answers (:mod:`.responses`) and JSON
(:mod:`.jsonio`). Nothing here knows rollouts: every other layer of the server may use
it, it uses none of them.
"""
